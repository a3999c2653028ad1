"""Run under torchrun: full and sharded (DCP) state of awkward shapes loads into FSDP2 shards.

Usage: torchrun --nproc_per_node N load_any_shape.py REPORT.json WORK_DIR

A module holds parameters whose dim 0 is 1 (fconv's weight_g), smaller than the number of
ranks, not a multiple of it, and 1-D ones; it is sharded by the plugin's FSDP2 engine, then
loaded from full tensors (as a fairseq checkpoint holds them) and from a sharded checkpoint
the plugin wrote from other values. Rank 0 writes, per shape, whether the gathered parameter
equals what was loaded.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from fairseq_shard_plugin.checkpoint.sharded import load_tensors, save_sharded
from fairseq_shard_plugin.sharding.engines import Fsdp2Engine
from fairseq_shard_plugin.sharding.full_state import (
    gather_full_state,
    loading_full_tensors_into_shards,
)
from fairseq_shard_plugin.sharding.settings import ShardingSettings
from fairseq_shard_plugin.sharding.wrap_policy import build_plan

SHAPES = {"dim0_of_1": (1, 1, 8), "one": (1,), "dim0_below_ranks": (2, 3),
          "uneven": (7, 3), "vector": (5,), "even": (12, 4)}


class Awkward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, shape in SHAPES.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))


def values(offset: float) -> dict[str, torch.Tensor]:
    return {name: torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
            + offset for name, shape in SHAPES.items()}


def gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    return gather_full_state(model.state_dict())


def main() -> None:
    report_path, work = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    model = Awkward()
    Fsdp2Engine(ShardingSettings()).shard(model, build_plan(model))
    report: dict[str, dict] = {"local_numel": {}, "full": {}, "sharded": {}}
    for name, param in model.named_parameters():
        report["local_numel"][name] = param.to_local().numel()

    full = values(1.0)
    with loading_full_tensors_into_shards(model), torch.no_grad():
        model.load_state_dict(full)
    after = gathered(model)
    report["full"] = {name: torch.equal(after[name], full[name]) for name in SHAPES}

    index = save_sharded({"model": model.state_dict()}, work, num_updates=1)
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().zero_()
    targets = {f"model/{name}": torch.empty_like(param)
               for name, param in model.named_parameters()}
    load_tensors(work / "checkpoint_1.pt", index, targets)
    report["sharded"] = {
        name: torch.equal(targets[f"model/{name}"].full_tensor(), full[name]) for name in SHAPES}
    if dist.get_rank() == 0:
        report_path.write_text(json.dumps(report))
    dist.barrier()
    # Exit without tearing gloo down: on a loaded machine its threads have aborted the
    # process at teardown ("terminate called without an active exception") after all work.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
