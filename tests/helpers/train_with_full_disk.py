"""Run fairseq-train on a disk that fills up: after update FULL_AFTER_UPDATE, every rank
may write files of at most FILE_LIMIT bytes.

Usage: FULL_AFTER_UPDATE=K FILE_LIMIT=BYTES python train_with_full_disk.py FAIRSEQ_ARGS...
The limit is the process's RLIMIT_FSIZE, with SIGXFSZ ignored, so a write past it fails
with EFBIG, as a write to a full disk fails with ENOSPC. The ranks' logs (files below the
limit) keep being written. Nothing in the plugin is replaced.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
from typing import Any

import fairseq_shard_plugin
from fairseq_shard_plugin.training.trainer import ShardedTrainer

FULL_AFTER_UPDATE = int(os.environ["FULL_AFTER_UPDATE"])
FILE_LIMIT = int(os.environ["FILE_LIMIT"])


def filling_the_disk(train_step: Any) -> Any:
    def step(self: ShardedTrainer, *args: Any, **kwargs: Any) -> Any:
        result = train_step(self, *args, **kwargs)
        if self.get_num_updates() == FULL_AFTER_UPDATE:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))
        return result
    return step


ShardedTrainer.train_step = filling_the_disk(ShardedTrainer.train_step)  # type: ignore[method-assign]

if __name__ == "__main__":
    from fairseq_cli.train import cli_main

    # the plugin's modules are imported already, so fairseq skips its user dir
    fairseq_shard_plugin.activate()

    sys.argv = ["fairseq-train", *sys.argv[1:]]
    cli_main()
