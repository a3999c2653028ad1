"""Run under torchrun: load a checkpoint into a fresh ShardedTrainer and compare.

Usage: torchrun ... reload_masters.py CHECKPOINT REPORT.json [fairseq args...]
Reports whether the gathered fp32 master parameters and optimizer state equal the file's.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from process_group import leave_process_group
from sharded_setup import build_trainer

from fairseq_shard_plugin.sharding.full_state import gather_full_state


def main() -> None:
    checkpoint, report_path, fairseq_args = sys.argv[1], sys.argv[2], sys.argv[3:]
    trainer, _, _ = build_trainer(fairseq_args)
    trainer.load_checkpoint(checkpoint)
    saved = torch.load(checkpoint, weights_only=True)
    model = gather_full_state(trainer.model.state_dict())
    optimizer = gather_full_state(trainer.optimizer.state_dict())
    params = dict(trainer.model.named_parameters())
    report = {
        "masters_equal": all(torch.equal(model[name], saved["model"][name]) for name in params),
        "master_dtypes": sorted({str(model[name].dtype) for name in params}),
        "saved_dtypes": sorted({str(saved["model"][name].dtype) for name in params}),
        "optimizer_equal": all(
            torch.equal(value, saved["last_optimizer_state"]["state"][index][key])
            for index, state in optimizer["state"].items()
            for key, value in state.items() if isinstance(value, torch.Tensor)
        ),
        "loss_scale": optimizer.get("loss_scale"),
        "saved_loss_scale": saved["last_optimizer_state"].get("loss_scale"),
    }
    if dist.get_rank() == 0:
        with open(report_path, "w") as out:
            json.dump(report, out)
    leave_process_group()


if __name__ == "__main__":
    main()
