"""GPU check, part 3: the one-GPU 3.3B recipe at world size 1, a few updates, measured.

``configs/nllb/finetune_3_3b_1gpu.yaml``'s settings (``hardware/one_24gb_gpu.yaml``: the
model state on the host in 16 bits under ``--cpu-offload``, fp16 Adam moments, activation
checkpointing, the chunked loss; 4,096 tokens per step) on the NLLB-200 3.3B shape spelled
out in fairseq's flags (24+24 layers, d 2048, ffn 8192, 16 heads, shared embeddings,
vocabulary 256,206), randomly initialised (the recipe fine-tunes released weights: the
same shapes and state). One step per update here, where the recipe accumulates 4: the host
step is the same per update, the forward and backward 4 times as many.

Recorded, for the README's estimates of this recipe: CUDA's peak allocated and reserved
(goal at most 8 GiB), the host's peak RSS (goal at most 48 GiB), seconds per update over
updates 3-6, the optimizer step call (``fairseq-shard-measure-train``'s ``step_seconds``)
and the share of the update that waited for the host's Adam step (the plugin's
``host_wait``: with the default overlap, the in-line part and the forward's waits). A
second run with ``--no-host-step-overlap`` follows when time is left: the share of the
host step that the overlap hides is the difference.

    python -m benchmarks.gpu_offload [--budget S]   # results/gpu_offload_3_3b.{md,json}
    python -m benchmarks.gpu_offload --dry-run      # on CPU, tiny model, temporary results
"""

from __future__ import annotations

import argparse
import time

from benchmarks.gpu_check import (
    CHUNKED_LOSS,
    GIB,
    NLLB_VOCABULARY,
    PLUGIN_TASK,
    CommandSeen,
    check_data,
    describe_launcher,
    on_cpu,
    parse_part_options,
    predicted_peak_gib,
    run_status,
    window_seconds,
)
from launching import harness
from launching.harness import run_training, training_args, transformer_args, write_results

NAME = "gpu_offload_3_3b"
MODEL = transformer_args(dim=2048, ffn=8192, layers=24, heads=16)
RECIPE = ["--cpu-offload", "--memory-efficient-fp16", "--fp16-adam-stats",
          "--checkpoint-activations", *CHUNKED_LOSS, *PLUGIN_TASK]
UPDATES, WINDOW = 6, (3, 6)
COLUMNS = [("run", "run"), ("status", "status"),
           ("CUDA peak allocated / reserved (GiB)", "cuda_peak_gib"),
           ("host peak RSS (GiB)", "host_peak_rss_gib"),
           ("predicted device peak (GiB)", "predicted_peak_gib"),
           ("s per update", "seconds_per_update"), ("step call (s)", "step_seconds"),
           ("waited for the host step (s)", "host_wait_seconds"),
           ("share of the update", "host_wait_share"), ("final loss", "final_loss")]


def measured_row(run: harness.RunResult | None, seconds: float, timeout: float,
                 window: tuple[int, int]) -> dict:
    """The row of one run: its peaks, and its updates ``window`` timed."""
    if run is None:
        return {"status": "not started: no time left"}
    memory = run.memory[0] if run.memory else {}
    row: dict = {"status": run_status(run, seconds, timeout), "seconds": round(seconds, 1),
                 "predicted_peak_gib": predicted_peak_gib(run.output)}
    for key in ("cuda_peak_allocated_bytes", "cuda_peak_reserved_bytes", "peak_rss_bytes"):
        if memory.get(key) is not None:
            row[key.replace("bytes", "gib")] = round(memory[key] / GIB, 2)
    if "cuda_peak_allocated_gib" in row:
        row["cuda_peak_gib"] = (f"{row['cuda_peak_allocated_gib']} / "
                                f"{row['cuda_peak_reserved_gib']}")
    row["host_peak_rss_gib"] = row.get("peak_rss_gib")
    starts, steps = memory.get("update_starts") or [], memory.get("step_seconds") or []
    first, last = window
    if len(starts) >= last and len(steps) >= last:
        per_update = window_seconds(starts, window) / (last - first + 1)
        step = sum(steps[first - 1:last]) / (last - first + 1)
        row.update(seconds_per_update=round(per_update, 2), step_seconds=round(step, 2))
        waits = run.series("train_inner", "host_wait")[first - 1:last]
        if len(waits) == last - first + 1:
            waited = sum(waits) / len(waits)
            row.update(host_wait_seconds=round(waited, 2),
                       host_wait_share=f"{100 * waited / per_update:.0f}%")
    losses = run.series("train_inner", "loss")
    row["final_loss"] = losses[-1] if losses else None
    if run.returncode != 0:
        row["error_tail"] = run.output[-2000:]
    return row


def offload(budget: float, dry_run: bool) -> str:
    """The recipe (or a tiny one on CPU) with the host step in the background, then in line
    if time is left; the rows written; the table returned."""
    deadline = time.monotonic() + budget
    work, data = check_data("gpu_offload", dry_run)
    if dry_run:
        model, tokens = transformer_args(dim=32, ffn=64, layers=1, heads=2), 256
        recipe = on_cpu(RECIPE)
    else:
        model, tokens, recipe = MODEL, 4096, RECIPE
    rows = []
    for name, flags in (("host step in the background (default)", []),
                        ("host step in line", ["--no-host-step-overlap"])):
        args = training_args(data, work / "run", max_update=UPDATES, max_tokens=tokens,
                             cpu=dry_run)
        args += model + recipe + flags + ["--no-save", "--disable-validation"]
        timeout = deadline - time.monotonic()
        seen, run, seconds = CommandSeen(), None, 0.0
        if timeout >= 20:
            start = time.monotonic()
            run = run_training(args, nproc=1, plugin=True, measure_dir=work / "memory",
                               cuda=True, timeout=timeout, check=False, watch=seen)
            seconds = time.monotonic() - start
        row = {"run": f"3.3B, the one-GPU recipe, world size 1, {name}",
               "launcher": describe_launcher(seen.command) if seen.command else "not started",
               **measured_row(run, seconds, timeout, WINDOW)}
        for _, key in COLUMNS:
            row.setdefault(key, None)
        rows.append(row)
    note = ("Produced by `bash benchmarks/gpu_check.sh offload` (`python -m "
            "benchmarks.gpu_offload`): the NLLB-200 3.3B shape (24+24 layers, d 2048, ffn "
            f"8192, vocabulary {NLLB_VOCABULARY:,}) with configs/nllb/finetune_3_3b_1gpu.yaml's "
            f"settings ({' '.join(RECIPE)}), world size 1, {tokens:,} tokens per update, one "
            f"step per update (the recipe accumulates 4), {UPDATES} updates, random weights. "
            f"Seconds per update, the step call and the waits for the host step over updates "
            f"{WINDOW[0]}-{WINDOW[1]}; CUDA peaks over the whole run; host: the process's "
            "peak RSS.")
    return write_results(NAME, rows, COLUMNS, note)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options = parse_part_options(parser, argv, 420, "gpu_offload")
    print(offload(options.budget, options.dry_run))


if __name__ == "__main__":
    main()
