"""``fairseq-shard-measure-train``: run ``fairseq-train`` under the live-tensor meter.

Measures any fairseq training, with or without the plugin, the same way: the peak of live
CPU tensor bytes over the whole process (model construction, training, validation), and
the peak resident set size; on a GPU also CUDA's peak allocated and reserved bytes. Each
rank writes ``{"rank", "peak_bytes", "peak_rss_bytes"[, "cuda_peak_allocated_bytes",
"cuda_peak_reserved_bytes"]}`` as JSON to the ``--measure-out`` path, where ``{rank}`` is
replaced by torchrun's rank.

CUDA's peaks are whole-process peaks too: stock fairseq's ``Trainer.train_step`` resets
CUDA's peak statistics every update (for its ``gb_free`` metric), and so does the plugin's
step probe, so in this process only ``torch.cuda.reset_peak_memory_stats`` first folds the
peaks so far into running maxima (:class:`PeaksAcrossResets`).

    fairseq-shard-measure-train --measure-out mem-{rank}.json DATA --arch ... (fairseq args)
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from fairseq_shard_plugin.memory.meters import LiveTensorMeter, peak_rss_bytes

USAGE = "usage: fairseq-shard-measure-train --measure-out PATH_WITH_{rank}.json FAIRSEQ_ARGS..."


class PeaksAcrossResets:
    """Peak statistics that survive someone else resetting them.

    ``reset`` is the statistics' reset (``torch.cuda.reset_peak_memory_stats``); ``peaks``
    name the readers of the peaks it resets (``torch.cuda.max_memory_allocated``, ...).
    :meth:`reset` stands in for the reset: it first folds what each reader returns into a
    running maximum, then resets; :meth:`fold` returns the maxima including the current
    peaks. Every reader is called with the reset's arguments (the device)."""

    def __init__(self, reset: Callable[..., Any], peaks: dict[str, Callable[..., int]]) -> None:
        self._reset = reset
        self._peaks = peaks
        self.maxima = dict.fromkeys(peaks, 0)

    def fold(self, *args: Any, **kwargs: Any) -> dict[str, int]:
        for name, read in self._peaks.items():
            self.maxima[name] = max(self.maxima[name], read(*args, **kwargs))
        return dict(self.maxima)

    def reset(self, *args: Any, **kwargs: Any) -> Any:
        self.fold(*args, **kwargs)
        return self._reset(*args, **kwargs)


@contextlib.contextmanager
def cuda_peaks_across_resets() -> Iterator[PeaksAcrossResets | None]:
    """While active, ``torch.cuda.reset_peak_memory_stats`` (also as reached through
    ``torch.cuda.memory``, e.g. by ``reset_max_memory_allocated``) folds CUDA's peaks before
    resetting them; None without CUDA."""
    if not torch.cuda.is_available():
        yield None
        return
    memory = torch.cuda.memory
    original = memory.reset_peak_memory_stats
    peaks = PeaksAcrossResets(original, {"allocated": memory.max_memory_allocated,
                                         "reserved": memory.max_memory_reserved})
    saved = torch.cuda.reset_peak_memory_stats
    torch.cuda.reset_peak_memory_stats = memory.reset_peak_memory_stats = peaks.reset
    try:
        yield peaks
    finally:
        torch.cuda.reset_peak_memory_stats, memory.reset_peak_memory_stats = saved, original


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
    with cuda_peaks_across_resets() as cuda_peaks:
        try:
            with meter:
                cli_main()
        finally:
            out.parent.mkdir(parents=True, exist_ok=True)
            record = {"rank": rank, "peak_bytes": meter.peak_bytes,
                      "peak_rss_bytes": peak_rss_bytes()}
            if cuda_peaks is not None:
                maxima = cuda_peaks.fold()
                record["cuda_peak_allocated_bytes"] = maxima["allocated"]
                record["cuda_peak_reserved_bytes"] = maxima["reserved"]
            out.write_text(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
