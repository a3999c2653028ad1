"""Let fairseq's optimizer update the plain local shards behind DTensor parameters.

fairseq's optimizers update parameters one operator at a time (Adam: about ten per
parameter); on a DTensor every operator goes through DTensor's Python dispatch, which on
small and medium models costs more than the arithmetic. Here the optimizer is given
plain tensors that share storage with each parameter's local shard, and before each step
their ``.grad`` is pointed at the local shard of the gradient: the same element-wise
update, on the same memory, without the dispatch. Checkpoint code keeps seeing DTensors:
:meth:`LocalShards.sharded_state` turns the optimizer's state back into DTensors sharded
like their parameters, and :meth:`LocalShards.local_state` accepts those (or full tensors).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fairseq_shard_plugin.sharding.full_state import shard_like


def _local_alias(param: torch.Tensor) -> torch.Tensor:
    """A plain leaf tensor sharing storage with ``param``'s local shard (``param`` itself
    when it is not a DTensor)."""
    if not isinstance(param, DTensor):
        return param
    with torch.no_grad():
        local = param.to_local().detach()
    return local.requires_grad_(param.requires_grad)  # fairseq drops tensors without it


class LocalShards:
    """Plain local tensors standing in for a list of (DTensor) parameters."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.locals = [_local_alias(p) for p in self.params]
        pairs = zip(self.locals, self.params, strict=True)
        self._param_of = {id(local): param for local, param in pairs}

    def bind(self) -> list[torch.Tensor]:
        """Point every local tensor at its parameter's current shard and gradient.

        FSDP may re-create a shard's tensor (at its lazy initialisation, say), so the storage
        is re-attached before each step. Returns the local gradients (None skipped).
        """
        grads = []
        with torch.no_grad():
            for param, local in zip(self.params, self.locals, strict=True):
                if local is param:
                    if param.grad is not None:
                        grads.append(param.grad)
                    continue
                local.data = param.to_local()
                grad = param.grad
                if grad is None:
                    local.grad = None
                    continue
                grad = grad.to_local() if isinstance(grad, DTensor) else grad
                local.grad = grad if grad.dtype == local.dtype else grad.to(local.dtype)
                grads.append(local.grad)
        return grads

    def zero_grad(self) -> None:
        """Drop the parameters' gradients. Those of the local stand-ins are the optimizer's
        to drop (fairseq's ``zero_grad`` clears its parameters' already, twice)."""
        for param in self.params:
            param.grad = None

    def _params_in_state_order(self, optimizer: torch.optim.Optimizer) -> Iterator[tuple]:
        """(local, param) in the order torch numbers the entries of a state dict."""
        for group in optimizer.param_groups:
            for local in group["params"]:
                yield local, self._param_of.get(id(local), local)

    def sharded_state(self, state_dict: dict[str, Any], optimizer: torch.optim.Optimizer
                      ) -> dict[str, Any]:
        """The optimizer's state dict with each local state tensor as a DTensor sharded like
        its parameter (tensors of another shape, such as step counters, unchanged)."""
        order = list(self._params_in_state_order(optimizer))
        state = {}
        for index, entry in state_dict["state"].items():
            local, param = order[index]
            state[index] = {
                key: _as_dtensor(value, param) if _is_shard_of(value, local, param) else value
                for key, value in entry.items()
            }
        return {**state_dict, "state": state}

    def local_state(self, state_dict: dict[str, Any], optimizer: torch.optim.Optimizer
                    ) -> dict[str, Any]:
        """Turn DTensor or full state tensors into this rank's local shards, for loading."""
        order = list(self._params_in_state_order(optimizer))
        state = {}
        for index, entry in state_dict.get("state", {}).items():
            _, param = order[index]
            state[index] = {key: _to_local(value, param) for key, value in entry.items()}
        return {**state_dict, "state": state}


def _is_shard_of(value: Any, local: torch.Tensor, param: torch.Tensor) -> bool:
    return (
        isinstance(param, DTensor)
        and isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and value.shape == local.shape
    )


def _as_dtensor(value: torch.Tensor, param: DTensor) -> DTensor:
    return DTensor.from_local(
        value, param.device_mesh, param.placements, run_check=False,
        shape=param.shape, stride=param.stride(),
    )


def _to_local(value: Any, param: torch.Tensor) -> Any:
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor):
        if value.placements != param.placements:
            value = value.redistribute(param.device_mesh, param.placements)
        return value.to_local()
    if value.shape == param.shape:  # a full tensor, as in a consolidated checkpoint
        return shard_like(value, param).to_local()
    return value  # already a local shard
