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


@torch.no_grad()  # (also: a DTensor's to_local() is then its local tensor, not a new view)
def global_grad_norm(params: Iterable[torch.nn.Parameter], device: torch.device,
                     shard_of: GradientShard = dtensor_shard) -> torch.Tensor:
    """L2 norm of all gradients, as if unsharded: shards' squares summed across ranks once.

    A shard held by several ranks (each replica of hybrid sharding) has its squares divided
    by their number before the all-reduce over all ranks, so each counts once. Gradients
    every rank holds whole are added after the all-reduce, so they count once too.
    The norms are taken a group of tensors at a time (``torch._foreach_norm``, in fp32 as
    fairseq's own clipping does), not parameter by parameter: a handful of operations per
    step instead of three per parameter, which on a GPU are as many kernel launches.
    """
    groups: dict[int | None, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is None:
            continue
        local, copies = shard_of(param, param.grad)
        groups.setdefault(copies, []).append(local)
    sharded = torch.zeros((), dtype=torch.float32, device=device)
    replicated = torch.zeros((), dtype=torch.float32, device=device)
    has_sharded = False
    for copies, tensors in groups.items():
        squares = _sum_of_squares(tensors, device)
        if copies is None:
            replicated = replicated + squares
        else:
            has_sharded = True
            sharded = sharded + (squares / copies if copies > 1 else squares)
    if has_sharded and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sharded)
    return (sharded + replicated).sqrt()


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of the squares of all elements of ``tensors`` (any devices and dtypes), in fp32
    on ``device``: one fp32 norm per tensor, one foreach call per device and dtype."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group in by_kind.values():
        norms = torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32))
        total = total + norms.to(device).square().sum()
    return total


def maxima_reducer(device: torch.device) -> Callable[[torch.Tensor], None] | None:
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
