"""Global gradient norm over sharded gradients, with one all-reduce."""

from __future__ import annotations

import math
from collections.abc import Iterable

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


def global_grad_norm(params: Iterable[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
    """L2 norm of all gradients, as if unsharded: shards' squares summed across ranks once.

    Under hybrid sharding every shard exists on each replica; its squares are divided by
    the number of replicas before the all-reduce over all ranks, so each counts once.
    Gradients that are not DTensors are replicated on every rank and added after the
    all-reduce, so they are counted once.
    """
    sharded = torch.zeros((), dtype=torch.float32, device=device)
    replicated = torch.zeros((), dtype=torch.float32, device=device)
    has_sharded = False
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            has_sharded = True
            squares = grad.to_local().float().pow(2).sum()
            copies = replicas(grad)
            sharded += (squares / copies if copies > 1 else squares).to(device)
        else:
            replicated += grad.float().pow(2).sum().to(device)
    if has_sharded and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sharded)
    return (sharded + replicated).sqrt()
