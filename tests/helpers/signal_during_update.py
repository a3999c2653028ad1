"""Run fairseq-train with SIGUSR1 sent to rank 1 by itself during one update.

Usage: SIGNAL_UPDATE=K [SIGNAL=SIGTERM] [WORKERS_FIRST=1] [SIGNAL_IN=validation]
python signal_during_update.py FAIRSEQ_ARGS... The signal arrives while update K runs (at
the start of its training step), as a scheduler's preemption notice may: exactly then,
where a signal from outside would race the step; with SIGNAL_IN=validation, in the first
validation step after update K. With WORKERS_FIRST=1 the rank's child processes (its
DataLoader workers) get the signal first, from another process, and have taken it (died of
it, or hold it pending) when the rank gets it, as when a scheduler signals the whole
process group and the rank is the last to take it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

import fairseq_shard_plugin
from fairseq_shard_plugin.training.trainer import ShardedTrainer

SIGNAL_UPDATE = int(os.environ["SIGNAL_UPDATE"])
SIGNAL = signal.Signals[os.environ.get("SIGNAL", "SIGUSR1")]
WORKERS_FIRST = os.environ.get("WORKERS_FIRST") == "1"
IN_VALIDATION = os.environ.get("SIGNAL_IN") == "validation"
stock_train_step = ShardedTrainer.train_step
stock_valid_step = ShardedTrainer.valid_step
sent: list[int] = []


def children() -> list[int]:
    return [int(pid) for path in Path("/proc/self/task").glob("*/children")
            for pid in path.read_text().split()]


def taken(pid: int) -> bool:
    """Whether the worker died of the signal (a zombie until reaped: its SIGCHLD is sent)
    or holds it pending (blocked)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    pending = int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
    return fields["State"].split()[0] == "Z" or bool(pending >> (SIGNAL - 1) & 1)


def send() -> None:
    sent.append(SIGNAL)
    if WORKERS_FIRST:
        workers = children()
        assert workers, "no DataLoader worker to signal (--num-workers 0?)"
        # from another process, as a scheduler's: a worker takes its parent's signal for a
        # shutdown and exits quietly
        subprocess.run(["kill", "-s", SIGNAL.name[3:], *map(str, workers)], check=True)
        deadline = time.monotonic() + 30
        while not all(taken(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.01)
    os.kill(os.getpid(), SIGNAL)


def train_step(self: ShardedTrainer, *args: Any, **kwargs: Any) -> Any:
    if (not IN_VALIDATION and not sent and self.get_num_updates() == SIGNAL_UPDATE - 1
            and dist.get_rank() == 1):
        send()
    return stock_train_step(self, *args, **kwargs)


def valid_step(self: ShardedTrainer, *args: Any, **kwargs: Any) -> Any:
    if (IN_VALIDATION and not sent and self.get_num_updates() >= SIGNAL_UPDATE
            and dist.get_rank() == 1):
        send()
    return stock_valid_step(self, *args, **kwargs)


ShardedTrainer.train_step = train_step  # type: ignore[method-assign]
ShardedTrainer.valid_step = valid_step  # type: ignore[method-assign]

if __name__ == "__main__":
    from fairseq_cli.train import cli_main

    # the plugin's modules are imported already, so fairseq skips its user dir
    fairseq_shard_plugin.activate()

    sys.argv = ["fairseq-train", *sys.argv[1:]]
    cli_main()
