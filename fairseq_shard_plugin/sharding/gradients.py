"""Global gradient norm over sharded gradients, with one all-reduce."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def replicas(tensor: DTensor) -> int:
    """How many ranks hold each element of ``tensor``: the product of its mesh dimensions
    with a ``Replicate`` placement (the replicate dimension of hybrid sharding)."""
    mesh = tensor.device_mesh
    return math.prod(
        mesh.size(dim) for dim, placement in enumerate(tensor.placements)
        if placement.is_replicate()
    )


# how one parameter's gradient enters the norm: its local tensor, and how many ranks hold
# each of its elements (None: every rank holds the whole gradient)
GradientShard = Callable[[torch.nn.Parameter, torch.Tensor], tuple[torch.Tensor, int | None]]


def dtensor_shard(param: torch.nn.Parameter, grad: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """FSDP2's gradients: a DTensor's local shard, held by its replicas (hybrid sharding);
    a plain tensor is replicated on every rank."""
    if isinstance(grad, DTensor):
        return grad.to_local(), replicas(grad)
    return grad, None


def global_grad_norm(params: Iterable[torch.nn.Parameter], device: torch.device,
                     shard_of: GradientShard = dtensor_shard) -> torch.Tensor:
    """L2 norm of all gradients, as if unsharded: shards' squares summed across ranks once.

    A shard held by several ranks (each replica of hybrid sharding) has its squares divided
    by their number before the all-reduce over all ranks, so each counts once. Gradients
    every rank holds whole are added after the all-reduce, so they count once too.
    """
    sharded = torch.zeros((), dtype=torch.float32, device=device)
    replicated = torch.zeros((), dtype=torch.float32, device=device)
    has_sharded = False
    for param in params:
        if param.grad is None:
            continue
        local, copies = shard_of(param, param.grad)
        squares = local.float().pow(2).sum().to(device)
        if copies is None:
            replicated += squares
        else:
            has_sharded = True
            sharded += squares / copies if copies > 1 else squares
    if has_sharded and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sharded)
    return (sharded + replicated).sqrt()


def max_over_ranks(device: torch.device) -> Callable[[torch.Tensor], None] | None:
    """A function replacing a CPU tensor's values by their maxima over all ranks (one
    all-reduce on ``device``, whose backend needs its tensors there), or None on one rank.
    Replicas of hybrid sharding hold equal values, so all ranks give the shard groups'."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None

    def reduce(values: torch.Tensor) -> None:
        on_device = values.to(device)
        dist.all_reduce(on_device, op=dist.ReduceOp.MAX)
        values.copy_(on_device)

    return reduce
