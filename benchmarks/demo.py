"""``make demo``: the plugin against stock fairseq, side by side, on 2 CPU ranks.

Generates a synthetic corpus, binarises it, trains the same small transformer twice with
the same seed and batches: once with ``--user-dir fairseq_shard_plugin --ddp-backend
fully_sharded``, once with stock fairseq (``--ddp-backend legacy_ddp``, no plugin). Both
run under ``fairseq-shard-measure-train``, so memory is measured the same way for both:
the whole-process peak of live tensor bytes on each rank. Writes the table to
``benchmarks/results/demo.md`` and ``demo.json``.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from benchmarks.harness import (
    REPO,
    RunResult,
    run_training,
    training_args,
    transformer_args,
    write_results,
)
from fairseq_shard_plugin.cli.synthetic_data import make_corpus

MIB = 1024**2


def prepare_corpus(work: Path) -> Path:
    if (work / "corpus" / "bin" / "dict.src.txt").exists():
        return work / "corpus" / "bin"
    return make_corpus(work / "corpus", vocab=300, train=8000, valid=300)


def summarize(name: str, run: RunResult) -> dict[str, object]:
    train, valid = run.logs["train"][-1], run.logs["valid"][-1]
    return {
        "run": name,
        "peak_mib_per_rank": round(max(rank["peak_bytes"] for rank in run.memory) / MIB, 1),
        "peak_rss_mib_per_rank": round(max(r["peak_rss_bytes"] for r in run.memory) / MIB, 1),
        "train_loss": float(train["train_loss"]),
        "valid_loss": float(valid["valid_loss"]),
        "words_per_second": float(train["train_wps"]),
        "updates": int(float(train["train_num_updates"])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--work", type=Path, default=REPO / "demo_work")
    args = parser.parse_args()
    data = prepare_corpus(args.work)
    model = transformer_args(dim=256, ffn=1024, layers=3)
    rows = []
    for name, plugin in [("plugin: fully_sharded (FSDP2, per-layer units)", True),
                         ("stock fairseq: legacy_ddp", False)]:
        tag = "plugin" if plugin else "stock"
        shutil.rmtree(args.work / tag, ignore_errors=True)
        train = training_args(data, args.work / tag / "checkpoints", args.updates,
                              max_tokens=256)
        # Memory is measured by the launcher for both runs alike; the plugin's own
        # per-step meter would only add overhead to its words/s here.
        extra = ["--log-interval", "50", "--no-save"] + (
            ["--task", "sharded_translation", "--no-memory-report"] if plugin else [])
        print(f"training: {name} ...", flush=True)
        run = run_training(train + model + extra, nproc=2, plugin=plugin,
                           measure_dir=args.work / tag / "memory", timeout=3600)
        rows.append(summarize(name, run))
    ratio = rows[0]["peak_mib_per_rank"] / rows[1]["peak_mib_per_rank"]  # type: ignore[operator]
    table = write_results("demo", rows, [
        ("run", "run"), ("peak tensor memory / rank (MiB)", "peak_mib_per_rank"),
        ("peak RSS / rank (MiB)", "peak_rss_mib_per_rank"), ("train loss", "train_loss"),
        ("valid loss", "valid_loss"), ("words/s", "words_per_second"),
    ], f"Sharded peak tensor memory per rank: {ratio:.0%} of stock.\n"
       "Produced by `make demo` (2 gloo ranks on this CPU machine).")
    print("\n" + table)


if __name__ == "__main__":
    main()
