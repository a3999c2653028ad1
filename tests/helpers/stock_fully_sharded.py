"""Stock ``fairseq-train`` with its own ``--ddp-backend fully_sharded`` on CPU ranks, for tests.

The reference for the plugin's reading of fairseq's per-rank checkpoints: fairseq and
fairscale train and save (``--use-sharded-state``) with their own code. What CPU ranks
lack is stood in for, and nothing else: fairscale's CUDA stream calls become no-ops
(``cpu_streams``), its units compute on the CPU (fairscale's default compute device is
CUDA), fairseq's ``.cuda()`` of the gradient norm under FSDP stays on the CPU, and
fairseq 0.12 reads its own checkpoints under torch >= 2.6 through the plugin's allow-list
of fairseq's checkpoint types (weights_only loading refuses ``argparse.Namespace``).
Run through ``launching/stock_launch.sh`` (``FAIRSEQ_TRAIN``), which adds the rank's
distributed flags.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_streams import emulate_cuda_streams_on_cpu  # noqa: E402


def compute_on_cpu() -> None:
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    stock_init = FullyShardedDataParallel.__init__

    def init(self: FullyShardedDataParallel, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("compute_device", torch.device("cpu"))
        stock_init(self, *args, **kwargs)

    FullyShardedDataParallel.__init__ = init
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # the one device is the CPU


if __name__ == "__main__":
    from fairseq_shard_plugin.checkpoint.safe_loading import allow_fairseq_checkpoint_types

    emulate_cuda_streams_on_cpu()
    compute_on_cpu()
    allow_fairseq_checkpoint_types()
    from fairseq_cli.train import cli_main

    cli_main()
