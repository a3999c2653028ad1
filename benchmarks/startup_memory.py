"""Host memory of building and sharding NLLB-600M at the start of a sharded training.

Each rank of a sharded run builds its model through fairseq and shards it. Layers are
sharded as fairseq builds them (``parallelize.shard_layer_as_built``), so a rank never holds
the whole fp32 model; before that change each rank built all of it first. This starts 2
ranks of ``fairseq-train`` on the ``nllb_dense_600m`` shape (synthetic data, the dictionary
padded to NLLB's 256,206 entries) and reads each rank's peak RSS (``VmHWM``) the moment the
plugin logs its sharding plan (the model is built and sharded; no step has run), then stops
the ranks. ``--plugin-dir`` measures another checkout of the plugin the same way (e.g. the
commit before the change, checked out with ``git worktree add``).

    python -m benchmarks.startup_memory [--plugin-dir OLD/fairseq_shard_plugin --label old]
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
FLAGS = ["--task", "sharded_translation", "--bf16",
         "--criterion", "chunked_label_smoothed_cross_entropy", "--loss-chunk-tokens", "512",
         "--checkpoint-activations", "--no-save", "--disable-validation"]
PLAN_LINE = "sharded over 2 ranks with fsdp2"


class PeakAtPlan:
    """Watches the ranks; once rank 0 has logged the plan, records every rank's peak RSS
    and kills the ranks (the measurement is taken, no step is needed)."""

    def __init__(self) -> None:
        self.peaks: list[int] = []

    def __call__(self, ranks: list, outputs: list[str]) -> None:
        if self.peaks or PLAN_LINE not in outputs[0]:
            return
        self.peaks = [process_memory(["VmHWM"], rank.pid).get("VmHWM", 0)
                      for rank in ranks]
        for rank in ranks:
            rank.kill()


def measure(data: Path, work: Path, plugin_dir: Path, arch: str) -> dict:
    """2 ranks started as torchrun starts them, with ``plugin_dir`` as the user dir."""
    watch = PeakAtPlan()
    command = [tool("fairseq-train"), *training_args(data, work, 10, max_tokens=1024),
               "--arch", arch, *FLAGS, "--user-dir", str(plugin_dir),
               "--ddp-backend", "fully_sharded"]
    start_ranks(command, 2, rank_environment(), watch=watch)
    if not watch.peaks:
        raise RuntimeError("the ranks ended before logging their sharding plan")
    return {"peak_rss_per_rank_gib": round(max(watch.peaks) / GIB, 2),
            "peak_rss_all_ranks_gib": round(sum(watch.peaks) / GIB, 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plugin-dir", type=Path, default=PLUGIN_DIR)
    parser.add_argument("--label", default="layers sharded as built")
    parser.add_argument("--arch", default="nllb_dense_600m")
    options = parser.parse_args(argv)
    from fairseq_shard_plugin.cli.synthetic_data import make_corpus

    with tempfile.TemporaryDirectory() as directory:
        data = make_corpus(Path(directory) / "data", vocab=2000, train=200, valid=20)
        pad_dictionary(data, NLLB_VOCABULARY)
        row = {"arch": options.arch, "build": options.label,
               **measure(data, Path(directory) / "save", options.plugin_dir, options.arch)}
    print(json.dumps(row), flush=True)
    path = RESULTS / "startup_memory.json"
    rows = [r for r in (json.loads(path.read_text()) if path.exists() else [])
            if (r.get("arch"), r["build"]) != (row["arch"], row["build"])] + [row]
    note = ("GiB, host memory of 2 CPU ranks of fairseq-train (NLLB shapes, fp32 weights: "
            "600M 2.29 GiB, 1.3B 5.11 GiB) with --bf16 and the plugin, once the model is "
            "built and sharded (peak RSS, VmHWM, read when rank 0 logs its plan). Produced "
            "by `python -m benchmarks.startup_memory --arch ARCH` (and, for the previous "
            "build, `--plugin-dir` of a checkout of the commit before the change with "
            "`--label`).")
    print(write_results("startup_memory", rows, [
        ("arch", "arch"), ("build", "build"), ("peak RSS per rank", "peak_rss_per_rank_gib"),
        ("both ranks", "peak_rss_all_ranks_gib")], note))


if __name__ == "__main__":
    main()
