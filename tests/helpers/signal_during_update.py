"""Run fairseq-train with SIGUSR1 sent to rank 1 by itself during one update.

Usage: SIGNAL_UPDATE=K [SIGNAL=SIGTERM] [WORKERS_FIRST=1] python signal_during_update.py
FAIRSEQ_ARGS... The signal arrives while update K runs (at the start of its training step),
as a scheduler's preemption notice may: exactly then, where a signal from outside would
race the step. With WORKERS_FIRST=1 the rank's child processes (its DataLoader workers)
get the signal first and have died of it when the rank gets it, as when a scheduler
signals the whole process group and the rank is the last to take it.
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
stock_train_step = ShardedTrainer.train_step


def children() -> list[int]:
    return [int(pid) for path in Path("/proc/self/task").glob("*/children")
            for pid in path.read_text().split()]


def dead(pid: int) -> bool:
    try:  # a zombie until its parent reaps it: its SIGCHLD is sent by then
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def train_step(self: ShardedTrainer, *args: Any, **kwargs: Any) -> Any:
    if self.get_num_updates() == SIGNAL_UPDATE - 1 and dist.get_rank() == 1:
        if WORKERS_FIRST:
            workers = children()
            assert workers, "no DataLoader worker to signal (--num-workers 0?)"
            # from another process, as a scheduler's: a worker takes its parent's signal
            # for a shutdown and exits quietly
            subprocess.run(["kill", "-s", SIGNAL.name[3:], *map(str, workers)], check=True)
            deadline = time.monotonic() + 30
            while not all(dead(pid) for pid in workers) and time.monotonic() < deadline:
                time.sleep(0.01)
        os.kill(os.getpid(), SIGNAL)
    return stock_train_step(self, *args, **kwargs)


ShardedTrainer.train_step = train_step  # type: ignore[method-assign]

if __name__ == "__main__":
    from fairseq_cli.train import cli_main

    # the plugin's modules are imported already, so fairseq skips its user dir
    fairseq_shard_plugin.activate()

    sys.argv = ["fairseq-train", *sys.argv[1:]]
    cli_main()
