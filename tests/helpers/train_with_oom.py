"""Run fairseq-train with an out-of-memory error raised on rank 1 only, once.

Usage: INJECT_UPDATE=K INJECT_PHASE=train|valid python train_with_oom.py FAIRSEQ_ARGS...
The error (torch's CUDA out-of-memory type, as a GPU raises it) comes from the first
decoder layer's forward, in the training step after K updates or in the validation after
update K: midway through the step's collectives, which the other rank goes on with.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

import fairseq_shard_plugin
from fairseq_shard_plugin.training.trainer import ShardedTrainer

INJECT_UPDATE = int(os.environ["INJECT_UPDATE"])
INJECT_IN_TRAINING = os.environ["INJECT_PHASE"] == "train"
pending = {"step": False, "injected": False}


def forward_failing_once(self: TransformerDecoderLayerBase, *args: Any, **kwargs: Any) -> Any:
    if pending["step"] and not pending["injected"] and dist.get_rank() == 1:
        pending["injected"] = True
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
    return original_forward(self, *args, **kwargs)


def watching(step: Any, in_training: bool) -> Any:
    def run(self: ShardedTrainer, *args: Any, **kwargs: Any) -> Any:
        pending["step"] = (in_training == INJECT_IN_TRAINING
                           and self.get_num_updates() == INJECT_UPDATE)
        return step(self, *args, **kwargs)
    return run


original_forward = TransformerDecoderLayerBase.forward
TransformerDecoderLayerBase.forward = forward_failing_once  # type: ignore[method-assign]
ShardedTrainer.train_step = watching(ShardedTrainer.train_step, True)  # type: ignore[method-assign]
ShardedTrainer.valid_step = watching(ShardedTrainer.valid_step, False)  # type: ignore[method-assign]

if __name__ == "__main__":
    from fairseq_cli.train import cli_main

    # the plugin's modules are imported already, so fairseq skips its user dir
    fairseq_shard_plugin.activate()

    sys.argv = ["fairseq-train", *sys.argv[1:]]
    cli_main()
