"""Per-rank memory of the same training on 1, 2 and 4 CPU ranks, and stock fairseq on 2.

The model (d 512, ffn 2048, 2+2 layers, 128 tokens per batch) is sized so that parameters,
gradients and Adam state dominate memory. Model state per rank comes from the plugin's
``state_mem_gb`` log field; peaks are whole-process peaks of live tensor bytes, measured
the same way for the plugin and stock fairseq by ``fairseq-shard-measure-train``.

    python -m benchmarks.scaling        # writes benchmarks/results/scaling.{md,json}
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from benchmarks.harness import (
    REPO,
    RunResult,
    in_threads,
    result_of,
    run_training,
    training_args,
    transformer_args,
    write_results,
)
from fairseq_shard_plugin.cli.synthetic_data import make_corpus

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


def main() -> None:
    work = REPO / "demo_work" / "scaling"
    runs = measure_scaling(make_corpus(work), work)
    rows = [{"run": name, "ranks": nproc,
             "model_state_mib_per_rank": None if state_gib(runs[name]) is None
             else round(state_gib(runs[name]) * 1024, 1),
             "peak_mib_per_rank": round(peak_bytes(runs[name]) / MIB, 1)}
            for name, nproc, _ in RUNS]
    table = write_results("scaling", rows, [
        ("run", "run"), ("ranks", "ranks"),
        ("model state / rank (MiB)", "model_state_mib_per_rank"),
        ("peak tensor memory / rank (MiB)", "peak_mib_per_rank"),
    ], "Produced by `.venv/bin/python -m benchmarks.scaling`.")
    print(table)


if __name__ == "__main__":
    main()
