"""Run under torchrun: load a checkpoint into a fresh ShardedTrainer and compare.

Usage: torchrun ... reload_masters.py CHECKPOINT REPORT.json [fairseq args...]
Reports whether the gathered parameters (fp32 masters, or 16-bit shards under the
memory-efficient flags) and optimizer state (moments and their fp16 scales) equal the
file's, and the sharded model state's bytes per parameter (all ranks together).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from process_group import leave_process_group
from sharded_setup import build_trainer

from fairseq_shard_plugin.sharding.full_state import gather_full_state


def state_bytes_per_parameter(trainer: Any) -> float:
    """Bytes of parameter shards and optimizer state on all ranks, per model parameter
    (gradients do not exist between steps)."""
    local_bytes = sum(p.to_local().nbytes for p in trainer.model.parameters())
    for state in trainer.optimizer.optimizer.state.values():
        local_bytes += sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
    total = torch.tensor(float(local_bytes))
    dist.all_reduce(total)
    return float(total) / sum(p.numel() for p in trainer.model.parameters())


def main() -> None:
    checkpoint, report_path, fairseq_args = sys.argv[1], sys.argv[2], sys.argv[3:]
    trainer, _, _ = build_trainer(fairseq_args)
    trainer.load_checkpoint(checkpoint)
    saved = torch.load(checkpoint, weights_only=True)
    model = gather_full_state(trainer.model.state_dict())
    optimizer = gather_full_state(trainer.optimizer.state_dict())
    params = dict(trainer.model.named_parameters())
    report = {
        # fairseq writes 16-bit tensors as fp32 (utils.move_to_cpu); compared in the file's
        "masters_equal": all(torch.equal(model[name].to(saved["model"][name].dtype),
                                         saved["model"][name]) for name in params),
        "master_dtypes": sorted({str(model[name].dtype) for name in params}),
        "saved_dtypes": sorted({str(saved["model"][name].dtype) for name in params}),
        "optimizer_equal": bool(optimizer["state"]) and all(
            torch.equal(value.float(), saved["last_optimizer_state"]["state"][index][key].float())
            if isinstance(value, torch.Tensor)
            else value == saved["last_optimizer_state"]["state"][index][key]
            for index, state in optimizer["state"].items() for key, value in state.items()
        ),
        "moment_dtypes": sorted({str(state["exp_avg"].dtype)
                                 for state in optimizer["state"].values()}),
        "state_bytes_per_parameter": state_bytes_per_parameter(trainer),
        "loss_scale": optimizer.get("loss_scale"),
        "saved_loss_scale": saved["last_optimizer_state"].get("loss_scale"),
    }
    if dist.get_rank() == 0:
        with open(report_path, "w") as out:
            json.dump(report, out)
    leave_process_group()


if __name__ == "__main__":
    main()
