"""Label-smoothed cross-entropy fused with the output projection, computed in token chunks.

The tokens x vocabulary logits never exist in full, neither in forward nor in backward:
forward keeps only each token's log-sum-exp; backward recomputes one chunk of logits at a
time and turns it into gradients for the hidden states and the projection weight at once.
The arithmetic matches fairseq's ``label_smoothed_nll_loss``: logits are computed in the
projection weight's dtype (16 bits under mixed precision, as fairseq's output layer does) and
normalised in fp32. With a 16-bit weight, the matrix products of backward also run in 16 bits
and the weight gradient accumulates in the weight's dtype, so no fp32 copy of the vocabulary
matrix or of its gradient is ever made.
"""

from __future__ import annotations

from typing import Any

import torch


def _chunk_logits(
    features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    logits = features.to(weight.dtype) @ weight.t()
    if bias is not None:
        logits = logits + bias
    return logits.float()


def _log_sum_exp_in_place(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` over the last dimension, overwriting ``logits`` instead of allocating
    temporaries of its size (``torch.logsumexp`` holds two more fp32 chunks on CPU)."""
    maxima = logits.amax(dim=-1, keepdim=True)
    return logits.sub_(maxima).exp_().sum(-1).log_().add_(maxima.squeeze(-1))


class _ChunkedLabelSmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        features: torch.Tensor,  # tokens x d_model
        weight: torch.Tensor,  # vocabulary x d_model
        bias: torch.Tensor | None,
        target: torch.Tensor,  # tokens
        epsilon: float,
        ignore_index: int,
        chunk_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        vocabulary = weight.size(0)
        eps_i = epsilon / (vocabulary - 1)
        keep = target.ne(ignore_index)
        log_normalizers = torch.empty(target.numel(), dtype=torch.float32, device=target.device)
        nll = torch.zeros((), dtype=torch.float32, device=target.device)
        smooth = torch.zeros((), dtype=torch.float32, device=target.device)
        correct = torch.zeros((), dtype=torch.long, device=target.device)
        for start in range(0, target.numel(), chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = _chunk_logits(features[rows], weight, bias)
            mask = keep[rows]
            target_logit = logits.gather(-1, target[rows].clamp(min=0).unsqueeze(-1)).squeeze(-1)
            logit_sum = logits.sum(-1)
            correct += (logits.argmax(-1).eq(target[rows]) & mask).sum()
            lse = _log_sum_exp_in_place(logits)
            log_normalizers[rows] = lse
            nll -= ((target_logit - lse) * mask).sum()
            smooth -= ((logit_sum - vocabulary * lse) * mask).sum()
            del logits
        ctx.save_for_backward(features, weight, bias, target, log_normalizers)
        ctx.eps, ctx.eps_i, ctx.ignore_index, ctx.chunk_tokens = (
            epsilon, eps_i, ignore_index, chunk_tokens
        )
        ctx.mark_non_differentiable(nll, correct)
        loss = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
        return loss, nll, correct

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *unused: Any) -> tuple[Any, ...]:  # type: ignore[override]
        features, weight, bias, target, log_normalizers = ctx.saved_tensors
        vocabulary = weight.size(0)
        target_weight = 1.0 - ctx.eps - ctx.eps_i
        softmax_weight = target_weight + ctx.eps_i * vocabulary
        grad_features = torch.empty_like(features)
        grad_weight = torch.zeros_like(weight)
        grad_bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            if bias is not None else None
        )
        scale = grad_loss.float()
        for start in range(0, target.numel(), ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            chunk_target = target[rows]
            mask = chunk_target.ne(ctx.ignore_index)
            # d loss / d logits = softmax * (1 - eps + eps_i * (V - 1)) - (1 - eps - eps_i) * onehot
            #                     - eps_i, for tokens that are not padding
            grad_logits = _chunk_logits(features[rows], weight, bias)
            grad_logits.sub_(log_normalizers[rows].unsqueeze(-1)).exp_().mul_(softmax_weight)
            grad_logits.sub_(ctx.eps_i)
            grad_logits.scatter_add_(
                -1, chunk_target.clamp(min=0).unsqueeze(-1),
                torch.full((chunk_target.numel(), 1), -target_weight, device=grad_logits.device),
            )
            grad_logits.mul_((mask.float() * scale).unsqueeze(-1))
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            grad_logits = grad_logits.to(weight.dtype)
            grad_features[rows] = (grad_logits @ weight).to(features.dtype)
            grad_weight.addmm_(grad_logits.t(), features[rows].to(weight.dtype))
            del grad_logits
        return (
            grad_features,
            grad_weight.to(weight.dtype),
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None, None, None, None,
        )


def chunked_label_smoothed_cross_entropy(
    features: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    epsilon: float,
    ignore_index: int,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed label-smoothed loss, summed NLL and the number of correct argmax predictions.

    ``features`` are the decoder's hidden states (any leading shape, flattened here) and
    ``weight``/``bias`` the output projection's; padding positions (``ignore_index``) count
    for nothing.
    """
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be at least 1")
    flat = features.reshape(-1, features.size(-1))
    return _ChunkedLabelSmoothedCrossEntropy.apply(
        flat, weight, bias, target.reshape(-1), epsilon, ignore_index, chunk_tokens
    )
