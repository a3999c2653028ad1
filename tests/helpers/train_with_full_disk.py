"""Run fairseq-train on a disk that fills up: after update FULL_AFTER_UPDATE, every rank
may write files of at most FILE_LIMIT bytes (with FULL_AT=copies: once the first file of
that update's save is written, so that fairseq's copies of it fail).

Usage: FULL_AFTER_UPDATE=K FILE_LIMIT=BYTES [FULL_AT=copies] [FULL_ON_RANK=R]
python train_with_full_disk.py FAIRSEQ_ARGS... (FULL_ON_RANK: only that rank's disk fills)
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


def _fill() -> None:
    if os.environ.get("FULL_ON_RANK", os.environ["RANK"]) != os.environ["RANK"]:
        return  # another rank's disk (a node-local scratch disk) fills
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


def filling_the_disk(method: Any) -> Any:
    def call(self: ShardedTrainer, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        if self.get_num_updates() == FULL_AFTER_UPDATE:
            _fill()
        return result
    return call


if os.environ.get("FULL_AT") == "copies":
    ShardedTrainer.save_checkpoint = filling_the_disk(  # type: ignore[method-assign]
        ShardedTrainer.save_checkpoint)
else:
    ShardedTrainer.train_step = filling_the_disk(  # type: ignore[method-assign]
        ShardedTrainer.train_step)

if __name__ == "__main__":
    from fairseq_cli.train import cli_main

    # the plugin's modules are imported already, so fairseq skips its user dir
    fairseq_shard_plugin.activate()

    sys.argv = ["fairseq-train", *sys.argv[1:]]
    cli_main()
