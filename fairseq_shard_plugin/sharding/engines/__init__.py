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

from fairseq_shard_plugin.errors import ShardingConfigError
from fairseq_shard_plugin.sharding.engines import fsdp2
from fairseq_shard_plugin.sharding.full_state import gather_full_state
from fairseq_shard_plugin.sharding.gradients import global_grad_norm
from fairseq_shard_plugin.sharding.precision import mixed_precision_policy
from fairseq_shard_plugin.sharding.settings import ShardingSettings
from fairseq_shard_plugin.sharding.wrap_policy import ShardingPlan, ShardUnit


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

    def __init__(self, settings: ShardingSettings) -> None:
        self.settings = settings

    def _mesh(self) -> Any:
        return fsdp2.sharding_mesh(self.settings.device_type,
                                   self.settings.shard_group_size or dist.get_world_size())

    def _unit_policy(self) -> Any:
        return mixed_precision_policy(self.settings.compute_dtype,
                                      self.settings.reduce_in_16_bit)

    def shard_layers(self, layers: list[nn.Module]) -> None:
        """Transformer layers sharded together as :meth:`shard` shards a layer unit, while
        fairseq builds the model (:func:`..parallelize.shard_layer_as_built`)."""
        mesh = self._mesh()
        unit = ShardUnit(type(layers[0]).__name__, tuple(layers),
                         reshard_after_forward=self.settings.reshard.layers)
        fsdp2.shard_unit(unit, mesh, self._unit_policy(),
                         fsdp2.offload_policy(self.settings.offload, mesh))

    def shard(self, model: nn.Module, plan: ShardingPlan) -> nn.Module:
        settings = self.settings
        vocabulary = (mixed_precision_policy(settings.compute_dtype, reduce_in_16_bit=True)
                      if settings.reduce_vocabulary_in_16_bit else None)
        fsdp2.apply_plan(plan, self._mesh(), self._unit_policy(), offload=settings.offload,
                         vocabulary_mp_policy=vocabulary)
        return model

    def grad_norm(self, params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
        return global_grad_norm(params, device)

    def full_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict:
        return gather_full_state(state)

    def shard_loaded_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing left to do: the optimizer steps on local shards, whose state
        ``LocalShards.local_state`` sliced while it was loaded."""

    def gathered(self, plan: ShardingPlan) -> AbstractContextManager[None]:
        return fsdp2.gathered(plan)


class FairscaleEngine:
    """fairscale ``FullyShardedDataParallel`` with flat parameters (CUDA only)."""

    name = "fairscale"

    def __init__(self, settings: ShardingSettings) -> None:
        from fairseq_shard_plugin.sharding.engines.fairscale import FairscaleSettings

        device = (torch.device("cuda", torch.cuda.current_device())
                  if settings.device_type == "cuda" else torch.device("cpu"))
        self.settings = FairscaleSettings(
            compute_device=device,
            compute_dtype=settings.compute_dtype,
            sixteen_bit_parameters=settings.sixteen_bit_parameters,
            reduce_in_16_bit=settings.reduce_in_16_bit,
            checkpoint_activations=settings.checkpoint_activations,
            offload_activations=settings.offload_activations,
        )

    def shard(self, model: nn.Module, plan: ShardingPlan) -> nn.Module:
        from fairseq_shard_plugin.sharding.engines import fairscale

        return fairscale.apply_plan(plan, self.settings)

    def grad_norm(self, params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
        from fairseq_shard_plugin.sharding.engines import fairscale

        return global_grad_norm(params, device, fairscale.flat_shard)

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
        raise ShardingConfigError("generation in validation (--eval-bleu and the like) needs "
                                  "--shard-engine fsdp2")


def build_engine(settings: ShardingSettings) -> Engine:
    """The engine ``--shard-engine`` names, configured by the run's settings."""
    if settings.engine == "fsdp2":
        return Fsdp2Engine(settings)
    if settings.engine == "fairscale":
        return FairscaleEngine(settings)
    raise ShardingConfigError(f"unknown --shard-engine {settings.engine}: use fsdp2 or "
                              "fairscale")
