"""``fairseq-shard-measure-train``: run ``fairseq-train`` under the live-tensor meter.

Measures any fairseq training, with or without the plugin, the same way: the peak of live
CPU tensor bytes over the whole process (model construction, training, validation), and
the peak resident set size; on a GPU also CUDA's peak allocated and reserved bytes. Each
rank writes ``{"rank", "peak_bytes", "peak_rss_bytes"[, "cuda_peak_allocated_bytes",
"cuda_peak_reserved_bytes"]}`` as JSON to the ``--measure-out`` path, where ``{rank}`` is
replaced by torchrun's rank.

    fairseq-shard-measure-train --measure-out mem-{rank}.json DATA --arch ... (fairseq args)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from fairseq_shard_plugin.memory.meters import LiveTensorMeter, peak_rss_bytes

USAGE = "usage: fairseq-shard-measure-train --measure-out PATH_WITH_{rank}.json FAIRSEQ_ARGS..."


def _names_the_plugin_as_user_dir(fairseq_args: list[str]) -> bool:
    for flag, value in zip(fairseq_args, fairseq_args[1:], strict=False):
        if flag == "--user-dir":
            return os.path.basename(os.path.normpath(value)) == __name__.split(".")[0]
    return False


def main() -> None:
    argv = sys.argv[1:]
    if len(argv) < 2 or argv[0] != "--measure-out":
        sys.exit(USAGE)
    rank = int(os.environ.get("RANK", "0"))
    out = Path(argv[1].replace("{rank}", str(rank)))
    sys.argv = ["fairseq-train", *argv[2:]]
    if _names_the_plugin_as_user_dir(argv[2:]):
        # this module imported the package already, so fairseq would skip its user dir
        import fairseq_shard_plugin

        fairseq_shard_plugin.activate()
    from fairseq_cli.train import cli_main

    meter = LiveTensorMeter()
    try:
        with meter:
            cli_main()
    finally:
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {"rank": rank, "peak_bytes": meter.peak_bytes, "peak_rss_bytes": peak_rss_bytes()}
        if torch.cuda.is_available():
            record["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            record["cuda_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        out.write_text(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
