"""The memory-scaling trainings: one model on 1, 2 and 4 plugin ranks and 2 stock ranks,
each rank measured (run by ``benchmarks/scaling.py`` and ``tests/test_memory_scaling.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from launching.harness import (
    RunResult,
    in_threads,
    result_of,
    run_training,
    training_args,
    transformer_args,
)

MODEL = transformer_args(dim=512, ffn=2048, layers=2)
RUNS = [("plugin-1", 1, True), ("plugin-2", 2, True), ("plugin-4", 4, True), ("stock-2", 2, False)]
MIB = 1024**2


def measure_scaling(data: Path, work: Path, workers: int = 1) -> dict[str, RunResult]:
    """Train 4 updates in each configuration of ``RUNS``, each rank measured (``workers``
    configurations at a time: memory is per process, so the tests run two at once)."""
    def job(name: str, nproc: int, plugin: bool) -> Callable[[], RunResult]:
        args = training_args(data, work / name / "save", max_update=4, max_tokens=128)
        args += MODEL + ["--no-save", "--disable-validation"]
        return lambda: run_training(args, nproc=nproc, plugin=plugin,
                                    measure_dir=work / name / "memory")

    results = in_threads({name: job(name, nproc, plugin) for name, nproc, plugin in RUNS},
                         workers)
    return {name: result_of(results, name) for name, _, _ in RUNS}


def state_gib(run: RunResult) -> float | None:
    values = run.series("train", "train_state_mem_gb")
    return values[-1] if values else None


def peak_bytes(run: RunResult) -> int:
    return max(rank["peak_bytes"] for rank in run.memory)
