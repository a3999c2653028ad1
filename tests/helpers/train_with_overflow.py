"""Run fairseq-train under torchrun with an inf loss injected on rank 1 at one update.

Usage: INJECT_UPDATE=K REPORT=path.json torchrun ... train_with_overflow.py FAIRSEQ_ARGS...
The scaled loss on rank 1 becomes inf, so its gradients overflow (before the reduction
mixes them into every shard). Writes what the step changed: parameters, optimizer state,
loss scale, update count.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import fairseq_shard_plugin
from fairseq_shard_plugin.sharding.full_state import gather_full_state
from fairseq_shard_plugin.sharding.precision import ShardedMasterOptimizer
from fairseq_shard_plugin.training.trainer import ShardedTrainer

INJECT_UPDATE = int(os.environ["INJECT_UPDATE"])
inject_now = False


def backward_with_injection(self: ShardedMasterOptimizer, loss: torch.Tensor) -> None:
    if inject_now and dist.get_rank() == 1:
        loss = loss * float("inf")
    original_backward(self, loss)


def train_step_with_report(self: ShardedTrainer, samples, raise_oom=False):  # type: ignore[no-untyped-def]
    global inject_now
    if self.get_num_updates() != INJECT_UPDATE or hasattr(self, "_injected"):
        return original_train_step(self, samples, raise_oom)
    self._injected = True
    before = _snapshot(self)
    inject_now = True
    try:
        result = original_train_step(self, samples, raise_oom)
    finally:
        inject_now = False
    after = _snapshot(self)
    report = {
        "params_identical": all(torch.equal(before["model"][k], after["model"][k])
                                for k in before["model"]),
        "optimizer_identical": all(
            torch.equal(before["optim"][i][k], after["optim"][i][k])
            for i in before["optim"] for k in before["optim"][i]
            if isinstance(before["optim"][i][k], torch.Tensor)),
        "scale_before": before["scale"], "scale_after": after["scale"],
        "updates_before": before["updates"], "updates_after": after["updates"],
        "logged": result is not None,
    }
    if dist.get_rank() == 0:
        with open(os.environ["REPORT"], "w") as out:
            json.dump(report, out)
    return result


def _snapshot(trainer: ShardedTrainer) -> dict:
    return {
        "model": gather_full_state(trainer.model.state_dict()),
        "optim": gather_full_state(trainer.optimizer.state_dict()["state"]),
        "scale": trainer.optimizer.scaler.loss_scale,
        "updates": trainer.get_num_updates(),
    }


original_backward = ShardedMasterOptimizer.backward
original_train_step = ShardedTrainer.train_step
ShardedMasterOptimizer.backward = backward_with_injection  # type: ignore[method-assign]
ShardedTrainer.train_step = train_step_with_report  # type: ignore[method-assign]

if __name__ == "__main__":
    from fairseq_cli.train import cli_main

    # the plugin's modules are imported already, so fairseq skips its user dir
    fairseq_shard_plugin.activate()

    sys.argv = ["fairseq-train", *sys.argv[1:]]
    cli_main()
