"""Host memory of fine-tuning from a released checkpoint with the one-GPU recipe's settings,
measured on CPU ranks of one host.

The one-GPU recipe (``configs/nllb/finetune_3_3b_1gpu.yaml``) starts from a released fairseq
checkpoint: fp32 weights, no optimizer state. This writes such a file for an NLLB-shaped
model (the dictionary padded to NLLB's 256,206 entries), then runs ``fairseq-train`` on
``--ranks`` ranks (default 1) with ``--finetune-from-model`` and the recipe's settings
(``--cpu-offload``, 16-bit parameter and gradient shards, fp16 Adam moments, activation
checkpointing, the chunked loss) for one update, sampling each rank's resident memory from
``/proc/PID/status`` and ``smaps_rollup`` every 50 ms: anonymous pages (``RssAnon``: the
process's own memory) and file pages (``RssFile``: the mapped checkpoint, clean page cache
the kernel can reclaim and that all ranks of a host share; ``Pss_File`` divides each page
among the ranks that map it). Phases are told apart by the log: the model is built and sharded
(the plugin's plan line), the checkpoint is loaded (fairseq's "loaded checkpoint" line),
then the update. The estimator's host cases for the same run are printed beside it.

    python -m benchmarks.finetune_load [--arch nllb_dense_1_3b] [--ranks 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.gpu_check import pad_dictionary
from fairseq_shard_plugin.memory.meters import process_memory
from launching.harness import (
    PLUGIN_DIR,
    RESULTS,
    rank_environment,
    start_ranks,
    tool,
    training_args,
    write_results,
)

GIB = 1024**3
NLLB_VOCABULARY = 256206
TOKENS = 4096
RECIPE = ["--task", "sharded_translation", "--ddp-backend", "fully_sharded", "--cpu-offload",
          "--bf16", "--memory-efficient-bf16", "--fp16-adam-stats", "--checkpoint-activations",
          "--criterion", "chunked_label_smoothed_cross_entropy", "--loss-chunk-tokens", "512",
          "--no-save", "--disable-validation"]
PHASES = ("built", "loaded", "trained")
ESTIMATED = {"built": "model construction", "loaded": "load of released weights",
             "trained": "training step"}
LINES = {"built": "sharded over ", "loaded": "loaded checkpoint"}


def write_released_checkpoint(data: Path, arch: str, path: Path) -> int:
    """A checkpoint in the layout fairseq releases: the model's fp32 weights, its config
    and an empty optimizer history. Returns its size in bytes."""
    import torch
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    import fairseq_shard_plugin

    fairseq_shard_plugin.activate()  # the NLLB archs and the plugin's task
    flags = [str(data), "--task", "sharded_translation", "--arch", arch]
    cfg = convert_namespace_to_omegaconf(
        options.parse_args_and_arch(options.get_training_parser(), flags))
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    torch.save({
        "args": None, "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        "model": model.state_dict(), "criterion": {},
        "optimizer_history": [{"criterion_name": "LabelSmoothedCrossEntropyCriterion",
                               "optimizer_name": "FairseqAdam",
                               "lr_scheduler_state": {"best": None}, "num_updates": 0}],
        "task_state": {}, "extra_state": {"train_iterator": {"epoch": 1}},
        "last_optimizer_state": None,
    }, path)
    del model
    return path.stat().st_size


def resident(pid: int) -> dict[str, int]:
    """``RssAnon``, ``RssFile`` and ``VmHWM`` of a process, and its proportional share of
    file pages (``Pss_File``: a page that two processes map counts half in each), in
    bytes; empty for a process that has no memory (yet or any more)."""
    fields = {**process_memory(("RssAnon", "RssFile", "VmHWM"), pid),
              **process_memory(("Pss_File",), pid, "smaps_rollup")}
    return fields if len(fields) == 4 else {}


class PhaseSampler:
    """Per phase (decided by rank 0's log lines seen so far, so other ranks may still be
    finishing the previous one at its start): the ranks' anonymous memory when the phase
    began, their largest anonymous and file-backed resident memory and peak
    RSS so far (the largest rank's), and the largest file pages of all ranks together
    counted once (the sum of their proportional shares)."""

    def __init__(self) -> None:
        self.peaks: dict[str, dict[str, int]] = {}

    def __call__(self, ranks: list, outputs: list[str]) -> None:
        text = outputs[0].lower()
        phase = next((p for p in PHASES[:-1] if LINES[p] not in text), PHASES[-1])
        try:
            now = [resident(rank.pid) for rank in ranks]
        except (OSError, ValueError):  # a rank has just ended
            return
        if not all(now):
            return
        largest = {name: max(each[name] for each in now)
                   for name in ("RssAnon", "RssFile", "VmHWM")}
        largest["all_ranks_file"] = sum(each["Pss_File"] for each in now)
        peaks = self.peaks.setdefault(phase, {"start": largest["RssAnon"], **largest})
        for name, value in largest.items():
            peaks[name] = max(peaks[name], value)


def estimated(train_argv: list[str], file_bytes: int, ranks: int) -> dict[str, float]:
    """The estimator's host cases, GiB per rank, for the training command ``train_argv``
    (``fairseq-train``'s arguments, the data directory still there) as the trainer describes
    itself to the estimator, on ``ranks`` ranks."""
    from fairseq_shard_plugin.cli.estimate_command import flags_from_training_command
    from fairseq_shard_plugin.memory.estimate import run

    flags, shape = flags_from_training_command(
        ["--world-size", str(ranks), "--checkpoint-file-gib", str(file_bytes / GIB)],
        train_argv)
    return {name: round(case["per_rank_gib"], 2)
            for name, case in run(flags, shape)["host"]["cases"].items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="nllb_dense_600m")
    parser.add_argument("--plugin-dir", type=Path, default=PLUGIN_DIR,
                        help="another checkout's plugin (e.g. the commit before a change)")
    parser.add_argument("--label", default="file mapped")
    parser.add_argument("--ranks", type=int, default=1, help="ranks of this host")
    options = parser.parse_args(argv)
    from fairseq_shard_plugin.cli.synthetic_data import make_corpus

    with tempfile.TemporaryDirectory() as directory:
        data = make_corpus(Path(directory) / "data", vocab=2000, train=400, valid=20,
                           max_len=64)
        pad_dictionary(data, NLLB_VOCABULARY)
        released = Path(directory) / "released.pt"
        file_bytes = write_released_checkpoint(data, options.arch, released)
        command = [tool("fairseq-train"),
                   *training_args(data, Path(directory) / "save", 1, max_tokens=TOKENS),
                   "--arch", options.arch, *RECIPE, "--finetune-from-model", str(released),
                   "--user-dir", str(options.plugin_dir)]
        sampler = PhaseSampler()
        code, output = start_ranks(command, options.ranks, rank_environment(threads=None),
                                   timeout=3600, watch=sampler)
        if code != 0 or "train_inner" not in output:
            raise RuntimeError(f"the fine-tuning run failed ({code}):\n{output[-6000:]}")
        cases = estimated(command[1:], file_bytes, options.ranks)
    rows = [{"arch": options.arch, "build": options.label, "ranks": options.ranks,
             "phase": phase,
             "file_gib": round(file_bytes / GIB, 2),
             "anonymous_at_start_gib": round(peaks["start"] / GIB, 2),
             "anonymous_gib": round(peaks["RssAnon"] / GIB, 2),
             "file_pages_gib": round(peaks["RssFile"] / GIB, 2),
             "all_ranks_file_pages_gib": round(peaks["all_ranks_file"] / GIB, 2),
             "peak_rss_gib": round(peaks["VmHWM"] / GIB, 2),
             "estimated_gib": cases[ESTIMATED[phase]]}
            for phase, peaks in sampler.peaks.items()]
    print(json.dumps(rows), flush=True)
    path = RESULTS / "finetune_load.json"
    earlier = json.loads(path.read_text()) if path.exists() else []
    for row in earlier:  # rows measured before --ranks: one rank, no all-ranks column
        row.setdefault("ranks", 1)
        row.setdefault("all_ranks_file_pages_gib", None)
    kept = [r for r in earlier if (r["arch"], r["build"], r["ranks"])
            != (options.arch, options.label, options.ranks)]
    note = (f"GiB, CPU ranks of fairseq-train on one host fine-tuning from a released-layout fp32 "
            f"checkpoint (`--finetune-from-model`) with the one-GPU recipe's settings "
            f"(--cpu-offload, --memory-efficient-bf16, --fp16-adam-stats, activation "
            f"checkpointing, chunked loss, {TOKENS} tokens per rank), one update. Per "
            "phase and per rank (the largest rank's), sampled every 50 ms: anonymous "
            "resident memory (RssAnon, the process's own) and file pages (RssFile: the "
            "mapped checkpoint, page cache that ranks of a host share and the kernel can "
            "reclaim); file pages of all ranks counted once (the sum of their Pss_File); "
            "peak RSS is VmHWM at the phase's end. Estimated: fairseq-shard-estimate's "
            "host case for the phase (model construction, load of released weights, "
            "training step) per rank with the same settings and --cpu, which leaves out the "
            "Python process itself (0.37 GiB RSS with fairseq imported). Produced by "
            "`python -m benchmarks.finetune_load --arch ARCH --ranks N` (the previous "
            "build: `--plugin-dir` of a checkout of the commit before the change, with "
            "`--label`).")
    print(write_results("finetune_load", kept + rows, [
        ("arch", "arch"), ("build", "build"), ("ranks", "ranks"), ("phase", "phase"),
        ("checkpoint file", "file_gib"), ("anonymous at start", "anonymous_at_start_gib"),
        ("anonymous", "anonymous_gib"), ("file pages", "file_pages_gib"),
        ("file pages, all ranks", "all_ranks_file_pages_gib"), ("peak RSS", "peak_rss_gib"),
        ("estimated", "estimated_gib")], note))


if __name__ == "__main__":
    main()
