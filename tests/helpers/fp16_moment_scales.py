"""Run on 2 ranks: the scales of 16-bit Adam moments, as the trainer's optimizer sets them.

Usage: fp16_moment_scales.py REPORT.json [fairseq args with --fp16-adam-stats...]
Builds the ShardedTrainer the arguments describe, gives each rank's shards gradients of a
different magnitude (rank r: (r + 1) x randn), takes one step with the trainer's own
optimizer, and gathers per parameter: every rank's scale of the first moment and the
largest magnitude its fp16 shard holds. Rank 0 writes them.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from process_group import leave_process_group
from sharded_setup import build_trainer


def main() -> None:
    report_path, fairseq_args = sys.argv[1], sys.argv[2:]
    trainer, _, _ = build_trainer(fairseq_args)
    adam = trainer.optimizer.optimizer
    params = [p for group in adam.param_groups for p in group["params"]]
    generator = torch.Generator().manual_seed(dist.get_rank())
    for param in params:
        grad = torch.randn(param.shape, generator=generator) * (dist.get_rank() + 1)
        param.grad = grad.to(param.dtype)
    adam.step()
    mine = [[adam.state[p]["exp_avg_scale"],
             float(adam.state[p]["exp_avg"].float().abs().max()) if p.numel() else 0.0]
            for p in params]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        with open(report_path, "w") as out:
            json.dump({"optimizer": type(adam).__name__, "ranks": everyone}, out)
    leave_process_group()


if __name__ == "__main__":
    main()
