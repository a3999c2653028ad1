"""The chunked criterion equals fairseq's label-smoothed cross-entropy, without its memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fairseq import options, tasks

from fairseq_shard_plugin.memory.meters import LiveTensorMeter
from fairseq_shard_plugin.tasks.chunked_cross_entropy import chunked_label_smoothed_cross_entropy

from fairseq.criterions.label_smoothed_cross_entropy import (  # isort: skip
    label_smoothed_nll_loss,
)

from fairseq_shard_plugin.tasks import register  # noqa: E402  # isort: skip

register()  # the plugin's criterion, as --user-dir does

SMALL = ["--arch", "transformer", "--share-all-embeddings", "--encoder-layers", "1",
         "--decoder-layers", "2", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
         "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
         "--encoder-attention-heads", "2", "--decoder-attention-heads", "2", "--dropout", "0"]


def setup(corpus: Path, criterion: str, extra: list[str]):  # type: ignore[no-untyped-def]
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(corpus), *SMALL, "--criterion", criterion, "--label-smoothing", "0.1",
        "--optimizer", "adam", "--lr", "1e-3", *extra])
    task = tasks.setup_task(args)
    torch.manual_seed(0)
    model = task.build_model(args)
    task.load_dataset("valid")
    batch = task.get_batch_iterator(task.dataset("valid"), max_tokens=600).next_epoch_itr(
        shuffle=False)
    return task, model, task.build_criterion(args), next(batch)


@pytest.mark.parametrize("extra", [[], ["--report-accuracy", "--ignore-prefix-size", "1"]])
def test_loss_metrics_and_gradients_equal_the_stock_criterion(corpus: Path, extra) -> None:  # type: ignore[no-untyped-def]
    _, model, stock, sample = setup(corpus, "label_smoothed_cross_entropy", extra)
    _, _, chunked, _ = setup(corpus, "chunked_label_smoothed_cross_entropy",
                             [*extra, "--loss-chunk-tokens", "7"])
    results = []
    for criterion in (stock, chunked):
        model.zero_grad()
        loss, sample_size, logging_output = criterion(model, sample)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), sample_size, logging_output, grads))
    (loss_a, size_a, log_a, grads_a), (loss_b, size_b, log_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(log_b["nll_loss"], log_a["nll_loss"], rtol=1e-5, atol=1e-4)
    assert size_a == size_b and set(log_a) == set(log_b)
    if "--report-accuracy" in extra:
        assert (log_a["n_correct"], log_a["total"]) == (log_b["n_correct"], log_b["total"])
    assert grads_a.keys() == grads_b.keys()
    scale = max(float(g.abs().max()) for g in grads_a.values())
    for name, expected in grads_a.items():  # fp32 round-off, relative to the gradients' scale
        torch.testing.assert_close(grads_b[name], expected, rtol=1e-4, atol=1e-6 * scale)


def loss_memory(fused: bool, tokens: int, vocabulary: int, dim: int) -> int:
    """Peak bytes the loss adds (forward and backward) beyond its inputs."""
    torch.manual_seed(0)
    features = torch.randn(tokens, dim, requires_grad=True)
    weight = torch.randn(vocabulary, dim, requires_grad=True)
    target = torch.randint(4, vocabulary, (tokens,))
    target[::9] = 1  # padding
    with LiveTensorMeter([features, weight]) as meter:
        start = meter.live_bytes
        if fused:
            loss, _, _ = chunked_label_smoothed_cross_entropy(
                features, weight, None, target, 0.1, 1, chunk_tokens=32)
        else:
            logits = features @ weight.t()
            lprobs = torch.log_softmax(logits.float(), dim=-1)
            loss, _ = label_smoothed_nll_loss(lprobs, target, 0.1, ignore_index=1)
        loss.backward()
    return meter.peak_bytes - start


def test_peak_loss_memory_is_under_ten_percent_of_stock() -> None:
    shape = {"tokens": 1024, "vocabulary": 65536, "dim": 64}
    stock, fused = loss_memory(False, **shape), loss_memory(True, **shape)
    logits_bytes = 1024 * 65536 * 4
    assert stock > 2 * logits_bytes  # logits, log-probabilities and their gradients
    assert fused <= 0.10 * stock, (fused, stock)


def test_sixteen_bit_weights_match_stock_and_keep_gradients_in_their_dtype() -> None:
    torch.manual_seed(0)
    features = torch.randn(96, 32, dtype=torch.bfloat16, requires_grad=True)
    weight = (0.3 * torch.randn(500, 32)).to(torch.bfloat16).requires_grad_()
    target = torch.randint(4, 500, (96,))
    target[::7] = 1  # padding
    results = []
    for fused in (False, True):
        features.grad = weight.grad = None
        if fused:
            loss, _, _ = chunked_label_smoothed_cross_entropy(
                features, weight, None, target, 0.1, 1, chunk_tokens=40)
        else:  # fairseq: 16-bit logits, fp32 log-probabilities
            lprobs = torch.log_softmax((features @ weight.t()).float(), dim=-1)
            loss, _ = label_smoothed_nll_loss(lprobs, target, 0.1, ignore_index=1)
        loss.backward()
        results.append((loss.detach(), features.grad.clone(), weight.grad.clone()))
    (loss_a, features_a, weight_a), (loss_b, features_b, weight_b) = results
    assert weight_b.dtype == features_b.dtype == torch.bfloat16
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-3, atol=0)
    for got, expected in ((features_b, features_a), (weight_b, weight_a)):
        scale = float(expected.float().abs().max())
        torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=0.02 * scale)


@pytest.mark.parametrize("model_args", [
    ["--arch", "lstm", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
     "--decoder-out-embed-dim", "16"],
    ["--arch", "fconv_iwslt_de_en", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
     "--decoder-out-embed-dim", "16"],
    [*SMALL, "--adaptive-softmax-cutoff", "20"],
], ids=["lstm", "fconv", "adaptive softmax"])
def test_a_model_without_features_before_a_linear_projection_is_refused_before_training(
    corpus: Path, model_args: list[str]
) -> None:
    """These models failed at update 1 in a traceback (lstm's decoder takes no
    features_only): refused in one line where fairseq first holds model and criterion,
    before a trainer exists."""
    from fairseq_shard_plugin.errors import ShardingConfigError
    from fairseq_shard_plugin.fairseq_integration import _select_trainer

    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(corpus), *model_args, "--criterion", "chunked_label_smoothed_cross_entropy",
        "--label-smoothing", "0.1", "--optimizer", "adam", "--lr", "1e-3"])
    task = tasks.setup_task(args)
    model, criterion = task.build_model(args), task.build_criterion(args)

    class NoTrainer:
        def __init__(self, *args: object) -> None:
            raise AssertionError("a trainer was built")

    with pytest.raises(ShardingConfigError, match=(
            "^--criterion chunked_label_smoothed_cross_entropy needs a decoder that returns "
            f"its features before a linear output_projection .*; {type(model).__name__}'s "
            "does not: use --criterion label_smoothed_cross_entropy$")):
        _select_trainer(NoTrainer)(args, task, model, criterion)
