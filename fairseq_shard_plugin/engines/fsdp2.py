"""Apply a sharding plan with torch FSDP2 (``torch.distributed.fsdp.fully_shard``)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from fairseq_shard_plugin.wrap_policy import ShardingPlan, ShardUnit


def data_parallel_mesh(device_type: str) -> DeviceMesh:
    """A 1-D mesh over all ranks of the default process group."""
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _shard_unit(unit: ShardUnit, mesh: DeviceMesh) -> None:
    target = unit.modules[0] if len(unit.modules) == 1 else list(unit.modules)
    fully_shard(target, mesh=mesh, reshard_after_forward=unit.reshard_after_forward)


def apply_plan(plan: ShardingPlan, mesh: DeviceMesh) -> None:
    """Shard every unit of ``plan`` in place, inner units first, then the root."""
    for unit in plan.units:
        _shard_unit(unit, mesh)
    _shard_unit(plan.root, mesh)
