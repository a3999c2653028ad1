"""Sharding is measured, not assumed: per-rank memory of real runs on 1, 2 and 4 CPU ranks.

Configuration and measurement: ``benchmarks/scaling.py`` (the scaling table in
docs/memory.md comes from it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launching.harness import RunResult
from launching.scaling import measure_scaling, peak_bytes, state_gib

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)


@pytest.fixture(scope="module")
def runs(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    return measure_scaling(corpus, tmp_path_factory.mktemp("scaling"), workers=2)


@pytest.mark.parametrize("nproc", [2, 4])
def test_model_state_per_rank_is_one_nth(runs: dict[str, RunResult], nproc: int) -> None:
    one_rank, n_ranks = state_gib(runs["plugin-1"]), state_gib(runs[f"plugin-{nproc}"])
    assert one_rank is not None and n_ranks is not None
    assert one_rank > 0.2  # ~15M parameters: 4 bytes each for weights, grads, 2 Adam moments
    assert abs(n_ranks / (one_rank / nproc) - 1) <= 0.10


def test_sharded_peak_is_at_most_65_percent_of_stock(runs: dict[str, RunResult]) -> None:
    plugin_peak, stock_peak = peak_bytes(runs["plugin-2"]), peak_bytes(runs["stock-2"])
    assert len(runs["plugin-2"].memory) == len(runs["stock-2"].memory) == 2
    assert plugin_peak <= 0.65 * stock_peak, (plugin_peak, stock_peak)


def test_per_step_peak_in_logs_is_within_the_process_peak(runs: dict[str, RunResult]) -> None:
    for name in ("plugin-1", "plugin-2", "plugin-4"):
        step_peak_gib = runs[name].series("train", "train_peak_mem_gb")[-1]
        process_peak_gib = peak_bytes(runs[name]) / 1024**3
        assert 0 < step_peak_gib <= process_peak_gib + 1e-4
