"""Run fairseq-train whose rank KILLED_RANK is killed (SIGKILL, as the kernel's
out-of-memory killer ends a process) when update KILL_AT_UPDATE starts.

Usage: KILLED_RANK=R KILL_AT_UPDATE=K python rank_killed.py FAIRSEQ_ARGS...
Nothing in the plugin is replaced: the process just dies.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import fairseq_shard_plugin
from fairseq_shard_plugin.training.trainer import ShardedTrainer

stock_step = ShardedTrainer.train_step


def train_step(self: ShardedTrainer, *args: Any, **kwargs: Any) -> Any:
    if (os.environ["RANK"] == os.environ["KILLED_RANK"]
            and self.get_num_updates() + 1 == int(os.environ["KILL_AT_UPDATE"])):
        os.kill(os.getpid(), signal.SIGKILL)
    return stock_step(self, *args, **kwargs)


ShardedTrainer.train_step = train_step  # type: ignore[method-assign]

if __name__ == "__main__":
    from fairseq_cli.train import cli_main

    # the plugin's modules are imported already, so fairseq skips its user dir
    fairseq_shard_plugin.activate()

    sys.argv = ["fairseq-train", *sys.argv[1:]]
    cli_main()
