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
import json
import shutil
from pathlib import Path

from benchmarks.harness import REPO, RunResult, run_training, training_args, transformer_args
from fairseq_shard_plugin.synthetic_corpus import binarize, write_raw

RESULTS = REPO / "benchmarks" / "results"
MIB = 1024**2


def prepare_corpus(work: Path) -> Path:
    if not (work / "corpus" / "bin" / "dict.src.txt").exists():
        shutil.rmtree(work / "corpus", ignore_errors=True)
        write_raw(work / "corpus" / "raw", vocab=300,
                  sizes={"train": 8000, "valid": 300, "test": 300}, max_len=12, seed=1)
        binarize(work / "corpus" / "raw", work / "corpus" / "bin")
    return work / "corpus" / "bin"


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


def markdown(rows: list[dict[str, object]], command: str) -> str:
    header = ("| run | peak tensor memory / rank (MiB) | peak RSS / rank (MiB) | train loss "
              "| valid loss | words/s |\n|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['run']} | {r['peak_mib_per_rank']} | {r['peak_rss_mib_per_rank']} "
        f"| {r['train_loss']} | {r['valid_loss']} | {r['words_per_second']} |\n"
        for r in rows
    )
    ratio = rows[0]["peak_mib_per_rank"] / rows[1]["peak_mib_per_rank"]  # type: ignore[operator]
    return (f"{header}{body}\nSharded peak tensor memory per rank: {ratio:.0%} of stock.\n"
            f"Produced by `{command}` (2 gloo ranks on this CPU machine).\n")


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
    table = markdown(rows, "make demo")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "demo.md").write_text(table)
    (RESULTS / "demo.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("\n" + table)


if __name__ == "__main__":
    main()
