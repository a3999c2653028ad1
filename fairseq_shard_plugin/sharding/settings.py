"""The run's sharding settings, read from fairseq's configuration in one place.

:meth:`ShardingSettings.from_config` is the only code that turns fairseq's flags (and the
plugin's, :mod:`.options`) into sharding decisions; :func:`.parallelize.parallelize` and
the engines read nothing else. Each default is explained where it is set.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fairseq_shard_plugin.errors import ShardingConfigError
from fairseq_shard_plugin.sharding.options import ShardingConfig, sharding_options

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReshardPolicy:
    """Which kinds of unit free their gathered parameters after their forward.

    Freeing (True) is what makes sharding save memory: only the unit running holds a
    gathered copy, at the price of a second all-gather in backward. Each kind can be kept
    gathered instead, from its forward until its backward:

    - ``vocabulary`` (``--keep-vocabulary-gathered``): the tied embedding and output
      projection run up to three times per step; kept gathered, they are gathered once.
    - ``root`` (``--keep-root-gathered``): FSDP2 keeps its root gathered by default; the
      plugin frees it, because in models without layer units (an LSTM) the root holds most
      of the model, and its gathered copy would live through the whole step.
    - everything (``--no-reshard-after-forward``, fairseq's "ZeRO-2"): no all-gathers in
      backward, the whole model's gathered copy at the peak.
    """

    layers: bool = True
    vocabulary: bool = True
    root: bool = True

    @classmethod
    def from_flags(cls, keep_root_gathered: bool, keep_vocabulary_gathered: bool,
                   no_reshard_after_forward: bool) -> ReshardPolicy:
        if no_reshard_after_forward:
            return cls(layers=False, vocabulary=False, root=False)
        return cls(vocabulary=not keep_vocabulary_gathered, root=not keep_root_gathered)


def compute_dtype(common_cfg: Any) -> torch.dtype | None:
    """The 16-bit compute type fairseq's flags ask for, or None for fp32."""
    if common_cfg.fp16 or common_cfg.memory_efficient_fp16:
        return torch.float16
    if common_cfg.bf16 or common_cfg.memory_efficient_bf16:
        return torch.bfloat16
    return None


def sixteen_bit_parameters(common_cfg: Any) -> bool:
    """Whether the sharded parameters themselves are 16-bit: fairseq's memory-efficient
    flags, which keep no fp32 copy (16-bit parameters and gradients, fp32 arithmetic in
    the optimizer step). ``--fp16``/``--bf16`` keep fp32 master shards instead."""
    return bool(common_cfg.memory_efficient_fp16 or common_cfg.memory_efficient_bf16)


def precision_name(common_cfg: Any) -> str:
    """``fp16``, ``bf16`` or ``fp32``: :func:`compute_dtype` by name."""
    return {torch.float16: "fp16", torch.bfloat16: "bf16", None: "fp32"}[
        compute_dtype(common_cfg)]


def launcher_rank(environ: Mapping[str, str] = os.environ,
                  names: tuple[str, ...] = ("RANK", "SLURM_PROCID")) -> int | None:
    """This process's global rank as its launcher set it (torchrun's ``RANK``, else srun's
    ``SLURM_PROCID``; its rank on the node with ``LOCAL_RANK``, ``SLURM_LOCALID``); None
    when no launcher said."""
    for name in names:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return None


def ranks_per_node(environ: Mapping[str, str] = os.environ) -> int | None:
    """Ranks on this node as the launcher says: torchrun's ``LOCAL_WORLD_SIZE``, else Slurm's
    tasks per node (when several), else its GPUs on the node; None if nothing says."""
    for name, least in (
        ("LOCAL_WORLD_SIZE", 1), ("SLURM_NTASKS_PER_NODE", 2), ("SLURM_GPUS_ON_NODE", 1)
    ):
        value = environ.get(name, "")
        if value.isdigit() and int(value) >= least:
            return int(value)
    return None


def shard_group_size(
    options: ShardingConfig, world_size: int, environ: Mapping[str, str] = os.environ,
) -> int:
    """Ranks that share one copy of the model: all of them (full), or one node's (hybrid)."""
    if options.shard_strategy != "hybrid":
        return world_size
    size = options.shard_group_size or ranks_per_node(environ)
    if size is None:
        raise ShardingConfigError(
            "--shard-strategy hybrid needs the ranks per node: launch with torchrun or srun, "
            "or give --shard-group-size"
        )
    if world_size % size != 0:
        raise ShardingConfigError(
            f"--shard-strategy hybrid: world size {world_size} is not a multiple of {size} "
            "ranks per node: set --shard-group-size to a divisor of the world size"
        )
    if size >= world_size:
        # a configuration written for a cluster, run on one node: nothing to replicate over
        warn_once(f"--shard-strategy hybrid: all {world_size} ranks form one shard group "
                   f"({size} ranks per group), so this run shards fully over them (as "
                   "--shard-strategy full); hybrid sharding needs more than one group")
        return world_size
    return size


@functools.cache
def warn_once(message: str) -> None:
    """Log ``message`` once per process, on rank 0 only (validation and the trainer both
    ask for the group size)."""
    if launcher_rank() in (None, 0):
        logger.warning(message)


@dataclass(frozen=True)
class ShardingSettings:
    """Everything that decides how the model is sharded, typed and named."""

    engine: str = "fsdp2"  # --shard-engine: torch FSDP2 (CPU and CUDA) or fairscale (CUDA)
    device_type: str = "cpu"
    compute_dtype: torch.dtype | None = None  # gathered copies; None: fp32 compute
    # the shards themselves in compute_dtype (--memory-efficient-fp16/bf16), not fp32 masters
    sixteen_bit_parameters: bool = False
    # gradients are reduced in fp32 unless asked (--reduce-in-16-bit): sums over ranks of
    # 16-bit gradients lose the small ones
    reduce_in_16_bit: bool = False
    # the vocabulary units' gradients alone in 16 bits (--reduce-vocabulary-in-16-bit):
    # the largest reduce-scatter, whose fp32 input is the largest transient of backward
    reduce_vocabulary_in_16_bit: bool = False
    offload: bool = False  # --cpu-offload: shards, gradients and optimizer state on the host
    # with offload, the host's Adam step hidden behind the next forward (.host_step_overlap)
    host_step_overlap: bool = True
    shard_group_size: int = 0  # ranks sharing a model copy; 0: all (full sharding)
    reshard: ReshardPolicy = field(default_factory=ReshardPolicy)
    # --root-unit-only: stock fairseq's plan for NLLB-sized layers (one unit), to compare
    root_unit_only: bool = False
    layers_per_unit: int = 1  # --layers-per-unit: consecutive layers of a stack in one unit
    checkpoint_activations: bool = False  # applied by fairseq when it builds the layers
    offload_activations: bool = False

    @classmethod
    def from_config(cls, cfg: Any, world_size: int, use_cuda: bool,
                    environ: Mapping[str, str] = os.environ) -> ShardingSettings:
        """The settings of a ``fully_sharded`` run from fairseq's parsed configuration."""
        options = sharding_options(cfg.task)
        dist_cfg = cfg.distributed_training
        return cls(
            engine=options.shard_engine,
            device_type="cuda" if use_cuda else "cpu",
            compute_dtype=compute_dtype(cfg.common),
            sixteen_bit_parameters=sixteen_bit_parameters(cfg.common),
            reduce_in_16_bit=options.reduce_in_16_bit,
            reduce_vocabulary_in_16_bit=options.reduce_vocabulary_in_16_bit,
            offload=bool(dist_cfg.cpu_offload),
            host_step_overlap=not options.no_host_step_overlap,
            shard_group_size=shard_group_size(options, world_size, environ),
            reshard=ReshardPolicy.from_flags(
                options.keep_root_gathered, options.keep_vocabulary_gathered,
                bool(dist_cfg.no_reshard_after_forward)),
            root_unit_only=options.root_unit_only,
            layers_per_unit=options.layers_per_unit,
            checkpoint_activations=bool(getattr(cfg.model, "checkpoint_activations", False)),
            offload_activations=bool(getattr(cfg.model, "offload_activations", False)),
        )
