"""The one path from a run's settings to a sharded model.

:func:`parallelize` applies the steps in their order; every decision comes from
:class:`.settings.ShardingSettings` (read from fairseq's flags in one place), and each step
says why it is where it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fairseq_shard_plugin.sharding.engines import Engine, Fsdp2Engine, build_engine
from fairseq_shard_plugin.sharding.precision import cast_buffers
from fairseq_shard_plugin.sharding.settings import ShardingSettings
from fairseq_shard_plugin.sharding.wrap_policy import (
    LAYER_CLASSES,
    ShardingPlan,
    build_plan,
    describe_plan,
    refuse_adaptive_modules,
)


@dataclass(frozen=True)
class ShardedModel:
    """What :func:`parallelize` made: the module to train, its plan and the engine that
    applied it (which the trainer asks for norms, full state and gathering)."""

    module: nn.Module
    plan: ShardingPlan
    engine: Engine
    description: str  # the plan in one line, for the log


# Layers built but not sharded yet under --layers-per-unit N, per stack, until N exist.
_unsharded_layers: dict[str, list[nn.Module]] = {}


def shard_layer_as_built(layer: nn.Module, settings: ShardingSettings) -> nn.Module:
    """Shard a transformer layer the moment fairseq has built it, before the next exists.

    fairseq's ``build_encoder_layer`` / ``build_decoder_layer`` hand every layer to
    ``fsdp_wrap`` (integration hook 1), one by one and in construction order; sharding it
    there frees its full fp32 copy at once, so each rank's host never holds the whole
    model (only the embeddings, one layer and the shards so far). Nothing else changes:
    the layer is initialised exactly as before (same random numbers in the same order), and
    :func:`parallelize` later finds it among the plan's layer units, sharded with the same
    settings. With ``--layers-per-unit N`` each stack's layers wait until N of them exist
    and are sharded together, as the plan groups them (fairseq builds a stack's layers in
    order, one stack after the other); the rest of a stack is sharded by
    :func:`parallelize`. The fairscale engine and ``--root-unit-only`` build as before."""
    if (settings.engine != "fsdp2" or settings.root_unit_only
            or not isinstance(layer, LAYER_CLASSES)):
        return layer
    if settings.sixteen_bit_parameters and settings.compute_dtype is not None:
        layer.to(dtype=settings.compute_dtype)
    stack = "decoder" if isinstance(layer, TransformerDecoderLayerBase) else "encoder"
    waiting = _unsharded_layers.setdefault(stack, [])
    waiting.append(layer)
    if len(waiting) >= settings.layers_per_unit:
        Fsdp2Engine(settings).shard_layers(waiting)
        waiting.clear()
    return layer


def _cast_unsharded_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """The parameters not sharded yet, in ``dtype`` (the 16-bit shards of layers sharded as
    built are already): one at a time, so each fp32 copy is freed as it goes."""
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if not isinstance(param, DTensor) and param.is_floating_point():
                param.data = param.data.to(dtype)


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
    _unsharded_layers.clear()  # the model is built: the plan takes any rest of a stack
    refuse_adaptive_modules(model)
    plan = build_plan(model, settings.reshard, settings.root_unit_only,
                      settings.layers_per_unit)
    description = describe_plan(plan, settings.root_unit_only)  # counted before sharding
    built_sharded = sum(isinstance(unit.modules[0], FSDPModule) for unit in plan.units)
    if built_sharded:
        description += f" ({built_sharded} layer units sharded as fairseq built them)"
    engine = build_engine(settings)
    if settings.sixteen_bit_parameters and settings.compute_dtype is not None:
        _cast_unsharded_parameters(model, settings.compute_dtype)
    module = engine.shard(model, plan)
    if settings.compute_dtype is not None:
        cast_buffers(model, settings.compute_dtype)
    return ShardedModel(module, plan, engine, description)
