"""Per-rank memory of the same 2-rank sharded training in fp32, fp16 and bf16.

Model: d 512, ffn 2048, 2+2 layers, shared embeddings, 512 tokens per batch, Adam, 10
updates. Model state (fp32 masters, gradients, Adam moments) is the same in every precision;
16-bit compute halves the gathered parameters and the activations.

    python -m benchmarks.precision        # writes benchmarks/results/precision.{md,json}
"""

from __future__ import annotations

from fairseq_shard_plugin.cli.synthetic_data import make_corpus
from launching.harness import REPO, run_training, training_args, transformer_args, write_results

MODEL = transformer_args(dim=512, ffn=2048, layers=2)
PRECISIONS = [("fp32", []), ("fp16", ["--fp16"]), ("bf16", ["--bf16"])]
MIB = 1024**2


def main() -> None:
    work = REPO / "demo_work" / "precision"
    data = make_corpus(work)
    rows = []
    for name, flags in PRECISIONS:
        args = training_args(data, work / name, max_update=10, max_tokens=512)
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
    table = write_results("precision", rows, [
        ("precision", "precision"), ("model state / rank (MiB)", "model_state_mib_per_rank"),
        ("step peak / rank (MiB)", "step_peak_mib_per_rank"),
        ("process peak / rank (MiB)", "process_peak_mib_per_rank"), ("train loss", "train_loss"),
    ], "Produced by `.venv/bin/python -m benchmarks.precision` (2 gloo ranks, CPU).")
    print(table)


if __name__ == "__main__":
    main()
