"""Per-rank memory of the same training on 1, 2 and 4 CPU ranks, and stock fairseq on 2.

The model (d 512, ffn 2048, 2+2 layers, 128 tokens per batch) is sized so that parameters,
gradients and Adam state dominate memory. Model state per rank comes from the plugin's
``state_mem_gb`` log field; peaks are whole-process peaks of live tensor bytes, measured
the same way for the plugin and stock fairseq by ``fairseq-shard-measure-train``.

    python -m benchmarks.scaling        # writes benchmarks/results/scaling.{md,json}
"""

from __future__ import annotations

from fairseq_shard_plugin.cli.synthetic_data import make_corpus
from launching.harness import (
    REPO,
    write_results,
)
from launching.scaling import MIB, RUNS, measure_scaling, peak_bytes, state_gib


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
