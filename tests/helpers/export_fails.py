"""Run fairseq-train whose rank 0 cannot write more than FILE_LIMIT bytes per file once the
training has returned: its --export-consolidated fails (EFBIG, as a full disk fails with
ENOSPC) while the other ranks wait for the end.

Usage: FILE_LIMIT=BYTES python export_fails.py FAIRSEQ_ARGS...
"""

from __future__ import annotations

import os
import resource
import signal
import sys
from typing import Any

import torch.distributed as dist
from fairseq_cli import train

import fairseq_shard_plugin

FILE_LIMIT = int(os.environ["FILE_LIMIT"])
stock_main = train.main


def main(*args: Any, **kwargs: Any) -> Any:
    result = stock_main(*args, **kwargs)
    if dist.get_rank() == 0:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))
    return result


train.main = main

if __name__ == "__main__":
    # the plugin's modules are imported already, so fairseq skips its user dir
    fairseq_shard_plugin.activate()

    sys.argv = ["fairseq-train", *sys.argv[1:]]
    train.cli_main()
