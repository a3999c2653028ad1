"""Engines apply a :class:`~fairseq_shard_plugin.sharding.wrap_policy.ShardingPlan`; no policy here.

The trainer talks to an engine only through :class:`Engine`: shard the model, the global
gradient norm, the full (checkpoint) state, and slicing loaded optimizer state back into
shards. ``fsdp2`` keeps parameters as DTensors; ``fairscale`` as flat per-unit shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from fairseq_shard_plugin.sharding.engines import fsdp2
from fairseq_shard_plugin.sharding.full_state import (
    gather_full_state,
    shard_optimizer_state_like_params,
)
from fairseq_shard_plugin.sharding.gradients import global_grad_norm
from fairseq_shard_plugin.sharding.precision import mixed_precision_policy
from fairseq_shard_plugin.sharding.wrap_policy import ShardingPlan


class Engine(Protocol):
    """What the trainer needs from a sharding engine."""

    name: str

    def shard(self, model: nn.Module, plan: ShardingPlan) -> nn.Module:
        """Apply ``plan``; return the module to train (the model itself, or its wrapper)."""

    def grad_norm(self, params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The L2 norm of all gradients as if unsharded (one all-reduce)."""

    def full_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict:
        """fairseq's trainer state with full tensors on CPU; a collective."""

    def shard_loaded_state(self, optimizer: torch.optim.Optimizer) -> None:
        """After a full optimizer state was loaded, keep this rank's slices."""

    def gathered(self, plan: ShardingPlan) -> AbstractContextManager[None]:
        """All parameters gathered until exit: forwards of any submodule without collectives
        (generation in validation, see :func:`.fsdp2.gathered`)."""


class Fsdp2Engine:
    """torch ``fully_shard``: DTensor parameters, CPU/gloo and CUDA/NCCL."""

    name = "fsdp2"

    def __init__(self, device_type: str, compute_dtype: torch.dtype | None,
                 reduce_in_16_bit: bool, shard_group_size: int = 0,
                 offload: bool = False, reduce_vocabulary_in_16_bit: bool = False) -> None:
        self.device_type = device_type
        self.compute_dtype, self.reduce_in_16_bit = compute_dtype, reduce_in_16_bit
        # ranks per shard group (0: all ranks; fewer: hybrid sharding), CPU offload
        self.shard_group_size, self.offload = shard_group_size, offload
        self.reduce_vocabulary_in_16_bit = reduce_vocabulary_in_16_bit

    def shard(self, model: nn.Module, plan: ShardingPlan) -> nn.Module:
        mesh = fsdp2.sharding_mesh(
            self.device_type, self.shard_group_size or dist.get_world_size()
        )
        vocabulary_policy = (
            mixed_precision_policy(self.compute_dtype, True)
            if self.reduce_vocabulary_in_16_bit else None
        )
        fsdp2.apply_plan(plan, mesh,
                         mixed_precision_policy(self.compute_dtype, self.reduce_in_16_bit),
                         offload=self.offload, vocabulary_mp_policy=vocabulary_policy)
        return model

    def grad_norm(self, params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
        return global_grad_norm(params, device)

    def full_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict:
        return gather_full_state(state)

    def shard_loaded_state(self, optimizer: torch.optim.Optimizer) -> None:
        shard_optimizer_state_like_params(optimizer)

    def gathered(self, plan: ShardingPlan) -> AbstractContextManager[None]:
        return fsdp2.gathered(plan)


class FairscaleEngine:
    """fairscale ``FullyShardedDataParallel`` with flat parameters (CUDA only)."""

    name = "fairscale"

    def __init__(self, settings: Any) -> None:
        self.settings = settings  # engines.fairscale.FairscaleSettings

    def shard(self, model: nn.Module, plan: ShardingPlan) -> nn.Module:
        from fairseq_shard_plugin.sharding.engines import fairscale

        return fairscale.apply_plan(plan, self.settings)

    def grad_norm(self, params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
        from fairseq_shard_plugin.sharding.engines import fairscale

        return fairscale.global_grad_norm(params, device)

    def full_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict:
        from fairseq_shard_plugin.sharding.engines import fairscale

        state = dict(state, model=fairscale.full_model_state(state["model"]))
        if state.get("last_optimizer_state") is not None:
            state["last_optimizer_state"] = fairscale.full_optimizer_state(
                state["last_optimizer_state"], optimizer)
        return state

    def shard_loaded_state(self, optimizer: torch.optim.Optimizer) -> None:
        from fairseq_shard_plugin.sharding.engines import fairscale

        fairscale.shard_loaded_optimizer_state(optimizer)

    def gathered(self, plan: ShardingPlan) -> AbstractContextManager[None]:
        # validation.check_fairscale_engine refuses the options that would need it
        raise NotImplementedError("generation in validation needs --shard-engine fsdp2")


def build_engine(
    name: str,
    use_cuda: bool,
    compute_dtype: torch.dtype | None,
    reduce_in_16_bit: bool,
    model_cfg: Any = None,
    shard_group_size: int = 0,
    offload: bool = False,
    reduce_vocabulary_in_16_bit: bool = False,
) -> Engine:
    """The engine ``--shard-engine`` names, configured from the run's flags."""
    if name == "fsdp2":
        return Fsdp2Engine("cuda" if use_cuda else "cpu", compute_dtype, reduce_in_16_bit,
                           shard_group_size, offload, reduce_vocabulary_in_16_bit)
    if name == "fairscale":
        from fairseq_shard_plugin.sharding.engines.fairscale import FairscaleSettings

        device = (torch.device("cuda", torch.cuda.current_device()) if use_cuda
                  else torch.device("cpu"))
        return FairscaleEngine(FairscaleSettings(
            compute_device=device,
            compute_dtype=compute_dtype,
            reduce_in_16_bit=reduce_in_16_bit,
            checkpoint_activations=bool(getattr(model_cfg, "checkpoint_activations", False)),
            offload_activations=bool(getattr(model_cfg, "offload_activations", False)),
        ))
    raise ValueError(f"unknown --shard-engine {name}: use fsdp2 or fairscale")
