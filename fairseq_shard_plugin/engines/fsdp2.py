"""Apply a sharding plan with torch FSDP2 (``torch.distributed.fsdp.fully_shard``)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fairseq_shard_plugin.wrap_policy import ShardingPlan, ShardUnit


def data_parallel_mesh(device_type: str) -> DeviceMesh:
    """A 1-D mesh over all ranks of the default process group."""
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _shard_unit(unit: ShardUnit, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> None:
    target = unit.modules[0] if len(unit.modules) == 1 else list(unit.modules)
    fully_shard(target, mesh=mesh, reshard_after_forward=unit.reshard_after_forward,
                mp_policy=mp_policy)


def apply_plan(
    plan: ShardingPlan, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None
) -> None:
    """Shard every unit of ``plan`` in place, inner units first, then the root.

    ``mp_policy`` casts gathered parameters for compute; the shards stay in their dtype.
    """
    mp_policy = mp_policy or MixedPrecisionPolicy()
    for unit in plan.units:
        _shard_unit(unit, mesh, mp_policy)
    _shard_unit(plan.root, mesh, mp_policy)
