"""Convert between sharded (DTensor) training state and full tensors for checkpoints."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def gather_full_state(state: Any, _gathered: dict[int, torch.Tensor] | None = None) -> Any:
    """Replace every DTensor in a nested state by its full tensor on CPU.

    A DTensor found under several names (a tied embedding and output projection) is
    gathered once and all its names get the same tensor, so a checkpoint stores it once,
    as fairseq's own checkpoints do. A collective: every rank must call it on the same
    structure, in the same order.
    """
    gathered = {} if _gathered is None else _gathered
    if isinstance(state, DTensor):
        if id(state) not in gathered:
            local = state
            if local.device.type != local.device_mesh.device_type:
                # --cpu-offload on GPUs: CPU shards, gathered over the GPU mesh's NCCL group
                local = local.to(local.device_mesh.device_type)
            gathered[id(state)] = local.full_tensor().cpu()
        return gathered[id(state)]
    if isinstance(state, dict):
        return type(state)((key, gather_full_state(value, gathered))
                           for key, value in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(gather_full_state(value, gathered) for value in state)
    return state


def share_tied_tensors(model_state: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """``model_state`` with every name of a tied parameter holding the same tensor object.

    ``state_dict()`` detaches each name's tensor separately, so a tied embedding and output
    projection arrive as three objects; given one, :func:`gather_full_state` gathers it
    once and the checkpoint stores it once. Decided from the model's structure, the same on
    every rank."""
    shared = dict(model_state)
    for canonical, *others in tied_parameter_names(model):
        for name in others:
            if name in shared and canonical in shared:
                shared[name] = shared[canonical]
    return shared


def tied_parameter_names(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter held under more than one name (a tied embedding and
    output projection), the first in module order first."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def shard_like(full: torch.Tensor, param: DTensor) -> DTensor:
    """This rank's slice of the full tensor ``full`` (model or optimizer state), as a DTensor
    sharded like ``param``, in fresh memory; no communication (every rank holds ``full``).

    The slice is cut where ``full`` lives (the host, for a loaded checkpoint) and only the
    slice moves to the parameter's device: moving ``full`` first would put each whole
    tensor on the GPU for a moment (2 GiB for NLLB-3.3B's fp32 embedding)."""
    shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh,
                                                          param.placements)
    local = full
    for dim, (size, start) in enumerate(zip(shape, offset, strict=True)):
        if size != full.shape[dim]:
            local = local.narrow(dim, start, size)
    return DTensor.from_local(local.to(param.device, copy=True), param.device_mesh,
                              param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _shard_full_tensors(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                        *args: Any) -> None:
    """Load pre-hook of one module: each full tensor in ``state_dict`` for one of its DTensor
    parameters becomes that parameter's DTensor (this rank's slice; no communication)."""
    for name, param in module._parameters.items():
        value = state_dict.get(prefix + name)
        if (isinstance(param, DTensor) and isinstance(value, torch.Tensor)
                and not isinstance(value, DTensor) and value.shape == param.shape):
            state_dict[prefix + name] = shard_like(value, param)


@contextlib.contextmanager
def loading_full_tensors_into_shards(model: torch.nn.Module) -> Iterator[None]:
    """While active, ``model.load_state_dict`` accepts full tensors for sharded parameters
    of any shape.

    ``load_state_dict`` copies each tensor into its parameter with ``copy_``. A plain tensor
    copied into a DTensor is treated as replicated, and DTensor refuses the in-place
    placement change wherever it cannot shard the pair evenly: a parameter whose dim 0 is
    smaller than the number of ranks (fconv's weight-normed ``weight_g``, shape [1, 1, d]),
    which leaves some ranks an empty shard. Giving ``copy_`` a DTensor already sharded like
    the parameter works for every shape. The hooks run after fairseq's own
    ``upgrade_state_dict`` renames, on exactly the names the model loads.
    """
    handles = [module.register_load_state_dict_pre_hook(_shard_full_tensors)
               for module in model.modules()
               if any(isinstance(p, DTensor) for p in module._parameters.values())]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
