"""Criterion ``chunked_label_smoothed_cross_entropy``: fairseq's label-smoothed
cross-entropy with the same arguments and metrics, fused with the output projection and
computed in chunks of target tokens, so the tokens x vocabulary logits never exist.

Works with a tied, sharded embedding unit: the fused loss runs as a registered FSDP forward
method of the output projection, so FSDP gathers its weight once for all chunks and
reduce-scatters its gradient once.
"""

import dataclasses
import inspect
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from fairseq_shard_plugin.errors import ShardingConfigError
from fairseq_shard_plugin.sharding.wrap_policy import is_linear_layer
from fairseq_shard_plugin.tasks.chunked_cross_entropy import chunked_label_smoothed_cross_entropy

FUSED_METHOD = "fused_label_smoothed_cross_entropy"


@dataclass
class ChunkedLabelSmoothedCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig):
    loss_chunk_tokens: int = field(
        default=1024,
        metadata={"help": "target tokens per chunk of logits (peak loss memory ~ chunk x vocab)"},
    )


def _fused_loss(projection: torch.nn.Linear, features: torch.Tensor, *args: Any) -> Any:
    return chunked_label_smoothed_cross_entropy(
        features, projection.weight, getattr(projection, "bias", None), *args
    )


def chunked_loss_problem(model: Any) -> str | None:
    """Why ``model`` cannot take the chunked loss, or None: its decoder must return the
    features before a linear ``output_projection`` (``features_only``, as fairseq's
    transformer family does; not with an adaptive softmax)."""
    decoder = getattr(model, "decoder", None)
    projection = getattr(decoder, "output_projection", None)
    if (projection is not None and is_linear_layer(projection)
            and "features_only" in inspect.signature(decoder.forward).parameters):
        return None
    return (f"--criterion chunked_label_smoothed_cross_entropy needs a decoder that returns "
            f"its features before a linear output_projection (fairseq's transformer family, "
            f"without an adaptive softmax); {type(model).__name__}'s does not: use "
            f"--criterion label_smoothed_cross_entropy")


def refuse_unfit(model: Any) -> None:
    """Raise :class:`ShardingConfigError` for a model the chunked loss cannot be computed for."""
    problem = chunked_loss_problem(model)
    if problem:
        raise ShardingConfigError(problem)


def fused_loss(model: Any) -> Any:
    """The fused loss of the decoder's output projection, run as an FSDP forward method of
    the innermost sharding unit that holds the projection (the projection's own unit, or
    the root under ``--root-unit-only``), so that its weight is gathered for the call; the
    model is checked at the first call, not at every step."""
    projection = getattr(getattr(model, "decoder", None), "output_projection", None)
    if not hasattr(projection, _FUSED_CALL):
        refuse_unfit(model)
        setattr(projection, FUSED_METHOD, types.MethodType(_fused_loss, projection))
        unit = _innermost_unit(model, projection)
        if unit is not None:
            if unit is not projection:
                setattr(unit, FUSED_METHOD, getattr(projection, FUSED_METHOD))
            register_fsdp_forward_method(unit, FUSED_METHOD)
        setattr(projection, _FUSED_CALL, getattr(unit or projection, FUSED_METHOD))
    return getattr(projection, _FUSED_CALL)


_FUSED_CALL = "_fairseq_shard_plugin_fused_loss"  # (a bound method, never a module)


def _innermost_unit(model: Any, projection: torch.nn.Module) -> FSDPModule | None:
    """The sharding unit whose parameters include the projection's (None: not sharded)."""
    units = [module for module in model.modules() if isinstance(module, FSDPModule)
             and any(inner is projection for inner in module.modules())]
    return units[-1] if units else None  # modules() lists a unit before the units inside it


CHUNKED_CRITERION = "chunked_label_smoothed_cross_entropy"
# the options the criterion adds to fairseq's label-smoothed one (named when given without it)
CHUNKED_CRITERION_FLAGS = frozenset(
    "--" + option.name.replace("_", "-")
    for option in dataclasses.fields(ChunkedLabelSmoothedCrossEntropyConfig)
    if option.name not in {f.name for f in dataclasses.fields(
        LabelSmoothedCrossEntropyCriterionConfig)})


@register_criterion(CHUNKED_CRITERION, dataclass=ChunkedLabelSmoothedCrossEntropyConfig)
class ChunkedLabelSmoothedCrossEntropyCriterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(
        self,
        task: Any,
        sentence_avg: bool,
        label_smoothing: float,
        ignore_prefix_size: int = 0,
        report_accuracy: bool = False,
        loss_chunk_tokens: int = 1024,
    ) -> None:
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        if loss_chunk_tokens < 1:
            raise ShardingConfigError(
                f"--loss-chunk-tokens {loss_chunk_tokens}: give at least 1 (the number of "
                "target tokens whose logits exist at once; 1024 by default)")
        self.loss_chunk_tokens = loss_chunk_tokens

    def refuse_unfit_model(self, model: Any) -> None:
        """Refuse, before training starts, a model this loss cannot be computed for."""
        refuse_unfit(model)

    def forward(self, model: Any, sample: dict, reduce: bool = True) -> tuple:
        if not reduce:
            raise ValueError("chunked_label_smoothed_cross_entropy only computes summed losses")
        features, _ = model(**sample["net_input"], features_only=True)
        target = model.get_targets(sample, (features, None))
        if self.ignore_prefix_size > 0:
            features = features[:, self.ignore_prefix_size :, :]
            target = target[:, self.ignore_prefix_size :]
        loss, nll_loss, n_correct = fused_loss(model)(
            features, target, self.eps, self.padding_idx, self.loss_chunk_tokens
        )
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        if self.report_accuracy:
            logging_output["n_correct"] = int(n_correct)
            logging_output["total"] = int(target.ne(self.padding_idx).sum())
        return loss, sample_size, logging_output
