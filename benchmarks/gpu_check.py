"""GPU check on one CUDA device, at the NLLB-600M shape: the plugin's FSDP2 and fairscale
engines in fp16 against stock fairseq's own ``--ddp-backend fully_sharded`` (fairscale) path
as shipped, same model, data and seed.

The model is ``nllb_dense_600m``'s shape spelled out in fairseq's own flags (12+12 layers,
d 1024, ffn 4096, 16 heads, shared embeddings, pre-norm), so that stock fairseq, which does
not know the plugin's architecture names, trains the same thing; the joined dictionary is
padded to the NLLB vocabulary of 256,206 entries. Each run is measured by
``fairseq-shard-measure-train`` (CUDA peak allocated and reserved) and its loss read from
the log, next to the peak the plugin predicted before its first step (the estimator's
constants were measured on CPU: this is its first check on CUDA). One device means world
size 1: these runs compare the code paths and the memory features; the per-rank figures at
world size 2 come from ``benchmarks.memory --cuda``, which ``gpu_check.sh`` runs next.

    python -m benchmarks.gpu_check        # writes benchmarks/results/gpu_check.{md,json}
"""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.harness import REPO, run_training, training_args, transformer_args, write_results
from fairseq_shard_plugin.cli.synthetic_data import make_corpus

GIB = 1024**3
NLLB_VOCABULARY = 256_206  # fairseq's 4 special symbols included
MODEL = transformer_args(dim=1024, ffn=4096, layers=12, heads=16)
UPDATES = 30
RUN_TIMEOUT = 90  # seconds per run: four runs must fit the script's budget (gpu_check.sh)
RUNS = [
    ("stock fairseq fully_sharded (fairscale), fp16", False, ["--fp16"]),
    ("plugin fairscale engine, fp16", True,
     ["--fp16", "--task", "sharded_translation", "--shard-engine", "fairscale"]),
    ("plugin fsdp2, fp16", True, ["--fp16"]),
    ("plugin fsdp2, fp16, the NLLB configs' memory features", True,
     ["--fp16", "--task", "sharded_translation", "--criterion",
      "chunked_label_smoothed_cross_entropy", "--loss-chunk-tokens", "512",
      "--checkpoint-activations", "--reduce-vocabulary-in-16-bit",
      "--keep-vocabulary-gathered"]),
]


def pad_dictionary(data: Path, size: int) -> None:
    """Append unused entries to the joined dictionary until it has ``size`` entries (fairseq
    adds 4 specials); the binarised data keep their indices."""
    for name in ("dict.src.txt", "dict.tgt.txt"):
        path = data / name
        lines = path.read_text().splitlines()
        extra = [f"madeupword{i:06d} 0" for i in range(size - 4 - len(lines))]
        path.write_text("\n".join(lines + extra) + "\n")


def predicted_peak_gib(output: str) -> float | None:
    """The plugin's start-up prediction (``predicted peak: 6.13 GiB per rank, ...``), in
    GiB; None for stock fairseq."""
    match = re.search(r"predicted peak: ([\d.]+) (GiB|MiB) per rank", output)
    if match is None:
        return None
    return round(float(match.group(1)) / (1024 if match.group(2) == "MiB" else 1), 3)


def main() -> None:
    work = REPO / "demo_work" / "gpu_check"
    data = make_corpus(work, vocab=16000, train=20000, valid=200, max_len=60)
    pad_dictionary(data, NLLB_VOCABULARY)
    rows = []
    for name, plugin, flags in RUNS:
        tag = f"run{len(rows)}"
        args = training_args(data, work / tag, max_update=UPDATES, max_tokens=4096,
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
            "predicted_peak_gib": predicted_peak_gib(run.output),
            "final_loss": run.series("train_inner", "loss")[-1:] or None,
            "words_per_second": run.series("train", "train_wps")[-1:] or None,
        })
        if run.returncode != 0:
            (work / f"{tag}.log").write_text(run.output)
            rows[-1]["error_tail"] = run.output[-2000:]
    table = write_results("gpu_check", rows, [
        ("run", "run"), ("CUDA peak allocated (GiB)", "cuda_peak_allocated_gib"),
        ("CUDA peak reserved (GiB)", "cuda_peak_reserved_gib"),
        ("predicted peak (GiB)", "predicted_peak_gib"), ("final loss", "final_loss"),
        ("words/s", "words_per_second"),
    ], "Produced by `bash benchmarks/gpu_check.sh` on one GPU: the NLLB-600M shape (12+12 "
       f"layers, d 1024, ffn 4096, vocabulary {NLLB_VOCABULARY:,}), 4096 tokens per batch, "
       f"{UPDATES} updates, world size 1.")
    print(table)


if __name__ == "__main__":
    main()
