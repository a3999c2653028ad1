"""The one path from a run's settings to a sharded model.

:func:`parallelize` applies the steps in their order; every decision comes from
:class:`.settings.ShardingSettings` (read from fairseq's flags in one place), and each step
says why it is where it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from fairseq_shard_plugin.sharding.engines import Engine, build_engine
from fairseq_shard_plugin.sharding.precision import cast_buffers
from fairseq_shard_plugin.sharding.settings import ShardingSettings
from fairseq_shard_plugin.sharding.wrap_policy import ShardingPlan, build_plan, describe_plan


@dataclass(frozen=True)
class ShardedModel:
    """What :func:`parallelize` made: the module to train, its plan and the engine that
    applied it (which the trainer asks for norms, full state and gathering)."""

    module: nn.Module
    plan: ShardingPlan
    engine: Engine
    description: str  # the plan in one line, for the log


def parallelize(model: nn.Module, settings: ShardingSettings) -> ShardedModel:
    """Shard ``model`` in place, in this order:

    1. Activation checkpointing: already applied. fairseq wraps each layer in its
       checkpoint wrapper while building the model (``--checkpoint-activations``), which
       keeps the layer module itself: the wrap policy finds it, and FSDP's hooks go around
       the checkpointed forward, so the recomputation runs while the unit is gathered for
       its backward. (The fairscale engine swaps in fairscale's wrapper, inside its units.)
    2. The plan: which modules form units (:mod:`.wrap_policy`) and which kinds free their
       gathered parameters after forward (``settings.reshard``).
    3. Precision and sharding, unit by unit and the root last (FSDP requires inner units
       first): gathered copies in the compute dtype, gradients reduced in fp32 unless asked
       otherwise (:mod:`.engines`). The shards are fp32 masters, or under the memory-
       efficient flags the parameters cast to 16 bits before sharding (no fp32 copy).
    4. Buffers in the compute dtype: FSDP casts parameters, not buffers, and fairseq's
       layers mix them (positions, masks) with 16-bit activations.
    """
    plan = build_plan(model, settings.reshard, settings.root_unit_only)
    description = describe_plan(plan)  # counted before sharding changes the parameters
    engine = build_engine(settings)
    if settings.sixteen_bit_parameters and settings.compute_dtype is not None:
        model.to(dtype=settings.compute_dtype)
    module = engine.shard(model, plan)
    if settings.compute_dtype is not None:
        cast_buffers(model, settings.compute_dtype)
    return ShardedModel(module, plan, engine, description)
