"""Print, as JSON, where ``full_state.shard_like`` differs from torch's ``distribute_tensor``.

For world sizes 1-4 on a 1-D mesh and a 2 x 2 mesh (hybrid sharding: replicate, shard),
every rank in turn (a fake process group, one process), awkward shapes: each rank's local
slice must equal the one ``distribute_tensor`` cuts, in memory of its own.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fairseq_shard_plugin.sharding.full_state import shard_like  # noqa: E402

SHAPES = [(1, 1, 8), (1,), (2, 3), (7, 3), (5,), (12, 4), (0, 8)]
MESHES = [((size,), [Shard(0)]) for size in (1, 2, 3, 4)] + [((2, 2), [Replicate(), Shard(0)])]

problems = []
checked = 0
for mesh_shape, placements in MESHES:
    world = 1
    for size in mesh_shape:
        world *= size
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", mesh_shape)
        for shape in SHAPES:
            full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
            param = distribute_tensor(torch.zeros(shape), mesh, placements, src_data_rank=None)
            expected = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
            ours = shard_like(full, param)
            local = ours.to_local()
            checked += 1
            if not torch.equal(local, expected) or ours.shape != param.shape:
                problems.append(f"{mesh_shape} rank {rank} {shape}: {local.tolist()} "
                                f"!= {expected.tolist()}")
            elif local.numel() and local.untyped_storage().data_ptr() == \
                    full.untyped_storage().data_ptr():
                problems.append(f"{mesh_shape} rank {rank} {shape}: shares full's memory")
        dist.destroy_process_group()
print(json.dumps({"checked": checked, "problems": problems}))
