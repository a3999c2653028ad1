"""Run fairseq-train with SIGUSR1 sent to rank 1 by itself during one update.

Usage: SIGNAL_UPDATE=K python signal_during_update.py FAIRSEQ_ARGS...
The signal arrives while update K runs (at the start of its training step), as a
scheduler's preemption notice may: exactly then, where a signal from outside would race
the step.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch.distributed as dist

import fairseq_shard_plugin
from fairseq_shard_plugin.training.trainer import ShardedTrainer

SIGNAL_UPDATE = int(os.environ["SIGNAL_UPDATE"])
stock_train_step = ShardedTrainer.train_step


def train_step(self: ShardedTrainer, *args: Any, **kwargs: Any) -> Any:
    if self.get_num_updates() == SIGNAL_UPDATE - 1 and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    return stock_train_step(self, *args, **kwargs)


ShardedTrainer.train_step = train_step  # type: ignore[method-assign]

if __name__ == "__main__":
    from fairseq_cli.train import cli_main

    # the plugin's modules are imported already, so fairseq skips its user dir
    fairseq_shard_plugin.activate()

    sys.argv = ["fairseq-train", *sys.argv[1:]]
    cli_main()
