"""Global gradient norm over sharded gradients, with one all-reduce."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def global_grad_norm(params: Iterable[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
    """L2 norm of all gradients, as if unsharded: shards' squares summed across ranks once.

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
            sharded += grad.to_local().float().pow(2).sum().to(device)
        else:
            replicated += grad.float().pow(2).sum().to(device)
    if has_sharded and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sharded)
    return (sharded + replicated).sqrt()
