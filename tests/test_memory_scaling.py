"""Sharding is measured, not assumed: per-rank memory of real runs on 1, 2 and 4 CPU ranks.

The model (d 512, ffn 2048, 2+2 layers, 128 tokens per batch) is sized so that parameters,
gradients and Adam state dominate memory. Peaks are whole-process peaks of live tensor
bytes, measured the same way for the plugin and for stock fairseq.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.harness import RunResult, run_training, training_args, transformer_args

MODEL = transformer_args(dim=512, ffn=2048, layers=2)


def measured(corpus: Path, tmp: Path, nproc: int, plugin: bool) -> RunResult:
    args = training_args(corpus, tmp / "save", max_update=4, max_tokens=128) + MODEL + [
        "--no-save", "--disable-validation"]
    return run_training(args, nproc=nproc, plugin=plugin, measure_dir=tmp / "memory")


@pytest.fixture(scope="module")
def runs(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    return {
        name: measured(corpus, tmp_path_factory.mktemp(name), nproc, plugin)
        for name, nproc, plugin in [
            ("plugin-1", 1, True), ("plugin-2", 2, True), ("plugin-4", 4, True),
            ("stock-2", 2, False),
        ]
    }


@pytest.mark.parametrize("nproc", [2, 4])
def test_model_state_per_rank_is_one_nth(runs: dict[str, RunResult], nproc: int) -> None:
    one_rank = runs["plugin-1"].series("train", "train_state_mem_gb")[-1]
    n_ranks = runs[f"plugin-{nproc}"].series("train", "train_state_mem_gb")[-1]
    assert one_rank > 0.2  # ~15M parameters: 4 bytes each for weights, grads, 2 Adam moments
    assert abs(n_ranks / (one_rank / nproc) - 1) <= 0.10


def test_sharded_peak_is_at_most_65_percent_of_stock(runs: dict[str, RunResult]) -> None:
    plugin_peak = max(rank["peak_bytes"] for rank in runs["plugin-2"].memory)
    stock_peak = max(rank["peak_bytes"] for rank in runs["stock-2"].memory)
    assert len(runs["plugin-2"].memory) == len(runs["stock-2"].memory) == 2
    assert plugin_peak <= 0.65 * stock_peak, (plugin_peak, stock_peak)


def test_per_step_peak_in_logs_is_within_the_process_peak(runs: dict[str, RunResult]) -> None:
    for name in ("plugin-1", "plugin-2", "plugin-4"):
        step_peak_gib = runs[name].series("train", "train_peak_mem_gb")[-1]
        process_peak_gib = max(rank["peak_bytes"] for rank in runs[name].memory) / 1024**3
        assert 0 < step_peak_gib <= process_peak_gib + 1e-4
