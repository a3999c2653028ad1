"""``fairseq-shard-measure-train``: run ``fairseq-train`` under the meters.

Measures any fairseq training, with or without the plugin, the same way: the peak of live
CPU tensor bytes over the whole process (model construction, training, validation; the
live-tensor meter, on CPU runs only unless ``--tensor-meter``: it puts every operation
through Python), the peak resident set size, when each update's optimizer step began
(``update_starts``, for steady-state speed) and how long it took (``step_seconds``), on a
GPU CUDA's peak allocated and reserved bytes, and with ``--profile-updates FIRST-LAST`` a
profile of those updates (``update_timing``). Each rank writes ``{"rank", "completed",
"peak_bytes", "peak_rss_bytes", "update_starts", "step_seconds"[, "profile"][,
"cuda_peak_allocated_bytes", "cuda_peak_reserved_bytes"]}`` (``completed`` false: the run
failed, and the figures cover it until then)
as JSON to the ``--measure-out`` path, where ``{rank}`` is replaced by torchrun's rank.

CUDA's peaks are whole-process peaks too: stock fairseq's ``Trainer.train_step`` resets
CUDA's peak statistics every update (for its ``gb_free`` metric), and so does the plugin's
step probe, so in this process only ``torch.cuda.reset_peak_memory_stats`` first folds the
peaks so far into running maxima (:class:`PeaksAcrossResets`).

    fairseq-shard-measure-train --measure-out mem-{rank}.json DATA --arch ... (fairseq args)
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from fairseq_shard_plugin import names_this_plugin
from fairseq_shard_plugin.cli.update_timing import (
    StepDurations,
    UpdateClock,
    UpdateProfile,
    after_every_update,
    at_every_update,
)
from fairseq_shard_plugin.memory.meters import LiveTensorMeter, peak_rss_bytes
from fairseq_shard_plugin.sharding.settings import launcher_rank

USAGE = ("usage: fairseq-shard-measure-train --measure-out PATH_WITH_{rank}.json "
         "[--tensor-meter | --no-tensor-meter] [--profile-updates FIRST-LAST] FAIRSEQ_ARGS...")
# this script's own options after --measure-out, and whether each takes a value
OPTIONS = {"--tensor-meter": False, "--no-tensor-meter": False, "--profile-updates": True}


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
    """Whether ``--user-dir X`` or ``--user-dir=X`` names this plugin."""
    for index, flag in enumerate(fairseq_args):
        if flag == "--user-dir" and index + 1 < len(fairseq_args):
            return names_this_plugin(fairseq_args[index + 1])
        if flag.startswith("--user-dir="):
            return names_this_plugin(flag.split("=", 1)[1])
    return False


def _own_options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """This script's options (``--measure-out`` first, then any of ``OPTIONS``), and the
    fairseq arguments after them."""
    if len(argv) < 2 or argv[0] != "--measure-out":
        sys.exit(USAGE)
    options = {"--measure-out": argv[1]}
    rest = argv[2:]
    while rest and rest[0] in OPTIONS:
        if OPTIONS[rest[0]]:
            if len(rest) < 2:
                sys.exit(USAGE)
            options[rest[0]], rest = rest[1], rest[2:]
        else:
            options[rest[0]], rest = "", rest[1:]
    return options, rest


def _tensor_meter_wanted(options: dict[str, str], fairseq_args: list[str]) -> bool:
    """The live-tensor meter measures CPU tensors by putting every operation through Python
    (a dispatch mode): on by default for CPU runs, off on a GPU, where it would slow every
    update down (issue 28) and CUDA's own statistics measure the device."""
    if "--tensor-meter" in options:
        return True
    if "--no-tensor-meter" in options:
        return False
    return "--cpu" in fairseq_args or not torch.cuda.is_available()


def _profile_range(text: str) -> tuple[int, int]:
    """FIRST-LAST (or one update N), as :class:`UpdateProfile` takes them: from update 2 (a
    profile starts at the previous update's optimizer step), FIRST not after LAST."""
    first, dash, last = text.partition("-")
    try:
        bounds = int(first), int(last if dash else first)
    except ValueError:
        bounds = (0, 0)
    if not 2 <= bounds[0] <= bounds[1]:
        sys.exit(f"fairseq-shard-measure-train: --profile-updates {text}: give FIRST-LAST, "
                 "update numbers from 2 with FIRST not after LAST (e.g. 32-34)")
    return bounds


def main() -> None:
    options, fairseq_args = _own_options(sys.argv[1:])
    rank = launcher_rank() or 0  # torchrun's RANK, else srun's SLURM_PROCID
    out = Path(options["--measure-out"].replace("{rank}", str(rank)))
    sys.argv = ["fairseq-train", *fairseq_args]
    if _names_the_plugin_as_user_dir(fairseq_args):
        # this module imported the package already, so fairseq would skip its user dir
        import fairseq_shard_plugin

        fairseq_shard_plugin.activate()
    from fairseq_cli.train import cli_main

    meter = LiveTensorMeter() if _tensor_meter_wanted(options, fairseq_args) else None
    clock = UpdateClock()
    profile = (UpdateProfile(*_profile_range(options["--profile-updates"]))
               if "--profile-updates" in options else None)
    steps = StepDurations()
    # the step's own timer starts last and ends first: the clock's and the profile's work
    # is not counted in it
    hooks = [at_every_update(clock, *([profile] if profile else []), steps.started),
             after_every_update(steps.ended)]
    completed = False
    with cuda_peaks_across_resets() as cuda_peaks:
        try:
            with meter if meter is not None else contextlib.nullcontext():
                cli_main()
            completed = True
        except SystemExit as stop:  # fairseq's own exits; only a clean one completes
            completed = stop.code in (None, 0)
            raise
        finally:
            for hook in hooks:
                hook.remove()
            if profile is not None:
                profile.finish()
            out.parent.mkdir(parents=True, exist_ok=True)
            record = {"rank": rank, "completed": completed,  # False: the run failed
                      "peak_bytes": meter.peak_bytes if meter else None,
                      "peak_rss_bytes": peak_rss_bytes(), "update_starts": clock.starts,
                      "step_seconds": steps.seconds}
            if profile is not None:
                record["profile"] = profile.summary
            if cuda_peaks is not None:
                maxima = cuda_peaks.fold()
                record["cuda_peak_allocated_bytes"] = maxima["allocated"]
                record["cuda_peak_reserved_bytes"] = maxima["reserved"]
            out.write_text(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
