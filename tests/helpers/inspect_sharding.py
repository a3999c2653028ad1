"""Run under torchrun: build a real fairseq model and ShardedTrainer, report the sharding.

Usage: torchrun --nproc_per_node N inspect_sharding.py OUT_DIR DATA [fairseq args...]
Writes OUT_DIR/rank{R}.json with, per layer, whether it is its own FSDP unit, and per
parameter, whether this rank holds exactly its 1/N slice of the unsharded weights; also
the sharded global gradient norm against the norm of the gathered gradients.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from process_group import leave_process_group
from sharded_setup import build_trainer
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from fairseq_shard_plugin.sharding.gradients import global_grad_norm
from fairseq_shard_plugin.sharding.wrap_policy import LAYER_CLASSES


def main() -> None:
    out_dir, fairseq_args = Path(sys.argv[1]), sys.argv[2:]
    trainer, task, full = build_trainer(fairseq_args)
    model = trainer.model
    rank, world = dist.get_rank(), dist.get_world_size()

    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, LAYER_CLASSES):
            group = fully_shard.state(module)._fsdp_param_group
            owned = {id(p) for p in module.parameters()}
            in_group = {id(fp.sharded_param) for fp in group.fsdp_params}
            layers[name] = {
                "is_unit": isinstance(module, FSDPModule), "owns_exactly": owned == in_group
            }

    params = {}
    for name, param in model.named_parameters():
        expected = torch.chunk(full[name], world, dim=0)
        mine = expected[rank] if rank < len(expected) else full[name][:0]
        local = param.to_local() if isinstance(param, DTensor) else param
        params[name] = {
            "dtensor": isinstance(param, DTensor),
            "local_numel": local.numel(),
            "full_numel": full[name].numel(),
            "slice_matches": local.shape == mine.shape and torch.equal(local, mine),
        }

    task.load_dataset("train")
    batches = task.get_batch_iterator(task.dataset("train"), max_tokens=256, num_shards=world,
                                      shard_id=rank, seed=1).next_epoch_itr(shuffle=False)
    sample, _ = trainer._prepare_sample(next(batches))
    loss, _, _ = trainer.criterion(trainer.model, sample)
    loss.backward()
    sharded_norm = global_grad_norm(trainer.model.parameters(), torch.device("cpu")).item()
    gathered = [p.grad.full_tensor() for p in trainer.model.parameters() if p.grad is not None]
    gathered_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in gathered])).item()

    report = {"world": world, "layers": layers, "params": params,
              "sharded_grad_norm": sharded_norm, "gathered_grad_norm": gathered_norm}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    leave_process_group()


if __name__ == "__main__":
    main()
