"""Per-rank memory of the same 2-rank sharded training in fp32, fp16 and bf16.

Model: d 512, ffn 2048, 2+2 layers, shared embeddings, 512 tokens per batch, Adam, 10
updates. Model state (fp32 masters, gradients, Adam moments) is the same in every precision;
16-bit compute halves the gathered parameters and the activations.

    python -m benchmarks.precision        # writes benchmarks/results/precision.{md,json}
"""

from __future__ import annotations

import json
import shutil

from benchmarks.harness import REPO, run_training, training_args, transformer_args
from fairseq_shard_plugin.synthetic_corpus import binarize, write_raw

MODEL = transformer_args(dim=512, ffn=2048, layers=2)
PRECISIONS = [("fp32", []), ("fp16", ["--fp16"]), ("bf16", ["--bf16"])]
MIB = 1024**2


def main() -> None:
    work = REPO / "demo_work" / "precision"
    shutil.rmtree(work, ignore_errors=True)
    write_raw(work / "raw", vocab=300, sizes={"train": 1500, "valid": 100, "test": 100},
              max_len=12, seed=1)
    binarize(work / "raw", work / "bin")
    rows = []
    for name, flags in PRECISIONS:
        args = training_args(work / "bin", work / name, max_update=10, max_tokens=512)
        args += MODEL + flags + ["--no-save", "--disable-validation"]
        run = run_training(args, nproc=2, plugin=True, measure_dir=work / name / "memory")
        train = run.logs["train"][-1]
        rows.append({
            "precision": name,
            "model_state_mib_per_rank": round(float(train["train_state_mem_gb"]) * 1024, 1),
            "step_peak_mib_per_rank": round(float(train["train_peak_mem_gb"]) * 1024, 1),
            "process_peak_mib_per_rank": round(
                max(rank["peak_bytes"] for rank in run.memory) / MIB, 1),
            "train_loss": float(train["train_loss"]),
        })
    table = ("| precision | model state / rank (MiB) | step peak / rank (MiB) "
             "| process peak / rank (MiB) | train loss |\n|---|---|---|---|---|\n")
    table += "".join(
        f"| {r['precision']} | {r['model_state_mib_per_rank']} | {r['step_peak_mib_per_rank']} "
        f"| {r['process_peak_mib_per_rank']} | {r['train_loss']} |\n" for r in rows)
    table += "\nProduced by `.venv/bin/python -m benchmarks.precision` (2 gloo ranks, CPU).\n"
    results = REPO / "benchmarks" / "results"
    (results / "precision.md").write_text(table)
    (results / "precision.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(table)


if __name__ == "__main__":
    main()
