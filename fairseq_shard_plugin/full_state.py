"""Convert between sharded (DTensor) training state and full tensors for checkpoints."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def gather_full_state(state: Any) -> Any:
    """Replace every DTensor in a nested state by its full tensor on CPU.

    A collective: every rank must call it on the same structure, in the same order.
    """
    if isinstance(state, DTensor):
        if state.device.type != state.device_mesh.device_type:
            # --cpu-offload on GPUs: CPU shards, gathered over the GPU mesh's NCCL group
            state = state.to(state.device_mesh.device_type)
        return state.full_tensor().cpu()
    if isinstance(state, dict):
        return type(state)((key, gather_full_state(value)) for key, value in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(gather_full_state(value) for value in state)
    return state


def shard_optimizer_state_like_params(optimizer: torch.optim.Optimizer) -> None:
    """After loading full optimizer state, slice each tensor to its parameter's shard.

    Local slicing only (no communication): every rank holds the full loaded state.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                continue
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if (
                    isinstance(value, torch.Tensor)
                    and not isinstance(value, DTensor)
                    and value.shape == param.shape
                ):
                    state[key] = distribute_tensor(
                        value.to(param.device), param.device_mesh, param.placements,
                        src_data_rank=None,
                    )
