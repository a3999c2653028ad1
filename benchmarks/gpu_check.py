"""GPU check on one CUDA device: the plugin's FSDP2 and fairscale engines in fp16 against
stock fairseq's own ``--ddp-backend fully_sharded`` (fairscale) path, same model, data, seed.

Each run is measured by ``fairseq-shard-measure-train`` (CUDA peak allocated and reserved)
and its loss read from the log. Sized to finish in about 5 minutes on one H200.

    python -m benchmarks.gpu_check        # writes benchmarks/results/gpu_check.{md,json}
"""

from __future__ import annotations

from benchmarks.harness import REPO, run_training, training_args, transformer_args, write_results
from fairseq_shard_plugin.synthetic_corpus import make_corpus

GIB = 1024**3
MODEL = transformer_args(dim=1024, ffn=4096, layers=6, heads=16)
RUN_TIMEOUT = 150  # seconds per run: four runs must fit the script's 480 s
RUNS = [
    ("stock fairseq fully_sharded (fairscale), fp16", False, ["--fp16"]),
    ("plugin fairscale engine, fp16", True,
     ["--fp16", "--task", "sharded_translation", "--shard-engine", "fairscale"]),
    ("plugin fsdp2, fp16", True, ["--fp16"]),
    ("plugin fsdp2, fp16, chunked loss, activation checkpointing", True,
     ["--fp16", "--criterion", "chunked_label_smoothed_cross_entropy",
      "--checkpoint-activations"]),
]


def main() -> None:
    work = REPO / "demo_work" / "gpu_check"
    data = make_corpus(work, vocab=16000, train=20000, valid=200, max_len=60)
    rows = []
    for name, plugin, flags in RUNS:
        tag = f"run{len(rows)}"
        args = training_args(data, work / tag, max_update=50, max_tokens=4096,
                             cpu=False) + MODEL + flags + ["--no-save", "--disable-validation"]
        run = run_training(args, nproc=1, plugin=plugin, measure_dir=work / tag / "memory",
                           stock_backend="fully_sharded", cuda=True, timeout=RUN_TIMEOUT,
                           check=False)
        memory = run.memory[0] if run.memory else {}
        rows.append({
            "run": name,
            "returncode": run.returncode,
            "cuda_peak_allocated_gib": round(memory.get("cuda_peak_allocated_bytes", 0) / GIB, 3),
            "cuda_peak_reserved_gib": round(memory.get("cuda_peak_reserved_bytes", 0) / GIB, 3),
            "final_loss": run.series("train_inner", "loss")[-1:] or None,
            "words_per_second": run.series("train", "train_wps")[-1:] or None,
        })
        if run.returncode != 0:
            (work / f"{tag}.log").write_text(run.output)
            rows[-1]["error_tail"] = run.output[-2000:]
    table = write_results("gpu_check", rows, [
        ("run", "run"), ("CUDA peak allocated (GiB)", "cuda_peak_allocated_gib"),
        ("CUDA peak reserved (GiB)", "cuda_peak_reserved_gib"), ("final loss", "final_loss"),
        ("words/s", "words_per_second"),
    ], "Produced by `bash benchmarks/gpu_check.sh` on one GPU (d 1024, ffn 4096, 6+6 layers, "
       "vocabulary ~32K, 4096 tokens per batch, 50 updates).")
    print(table)


if __name__ == "__main__":
    main()
