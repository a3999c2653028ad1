"""Apply a sharding plan with torch FSDP2 (``torch.distributed.fsdp.fully_shard``)."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from fairseq_shard_plugin.errors import ShardingConfigError
from fairseq_shard_plugin.sharding.wrap_policy import ShardingPlan, ShardUnit

# FSDP2 warns once per module class whose forward returns a view: an in-place operation on
# that view downstream would skip its backward hook. fairseq's transformer layers and models
# return views (transposes), and the vocabulary unit's embeddings too (a lookup reshaped to
# batch x time x dim), which fairseq's encoders and decoders only ever scale out of place:
# sharded they give stock fairseq's losses and gradient norms (tests/test_sharded_training.py,
# test_fairseq_architectures.py). Only those units' warning is silenced (a unit of several
# layers, --layers-per-unit, names each).
_LAYER = r"FSDPTransformer(Encoder|Decoder)Layer(Base)?"  # the nllb branch builds the subclass
_HARMLESS_VIEW_OUTPUTS = (rf"FSDP2-wrapped module \(({_LAYER}(, {_LAYER})*|"
                          r"FSDP(Transformer(Model|LanguageModel)|BARTModel)|"
                          r"FSDPEmbedding(, FSDPEmbedding)*(, FSDPLinear)?)\) returned a view")


def data_parallel_mesh(device_type: str) -> DeviceMesh:
    """A 1-D mesh over all ranks of the default process group."""
    return init_device_mesh(device_type, (dist.get_world_size(),))


@functools.cache
def sharding_mesh(device_type: str, shard_group_size: int) -> DeviceMesh:
    """Full sharding (1-D mesh) when one shard group spans all ranks; otherwise a 2-D
    mesh (replicate, shard) for hybrid sharding: consecutive ranks, i.e. one node's ranks
    under torchrun and Slurm's block distribution, form a shard group; groups replicate.
    One mesh per process: layers sharded while the model is built and the units sharded
    after it share it."""
    world_size = dist.get_world_size()
    if shard_group_size == world_size:
        return data_parallel_mesh(device_type)
    return init_device_mesh(
        device_type,
        (world_size // shard_group_size, shard_group_size),
        mesh_dim_names=("replicate", "shard"),
    )


def offload_policy(offload: bool, mesh: DeviceMesh) -> OffloadPolicy:
    """FSDP2's CPU offload (sharded parameters, gradients and, through them, optimizer state
    live on CPU; the optimizer steps there) or none. Pinned memory only exists with CUDA."""
    if not offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")


def refuse_scalar_parameters(model: nn.Module) -> None:
    """FSDP2 shards along dim 0 and refuses 0-dim parameters with a traceback; say which
    parameter it is and what to change, before anything is sharded."""
    for name, param in model.named_parameters():
        if param.dim() == 0:
            raise ShardingConfigError(
                f"parameter {name} is a scalar (0-dim), which --shard-engine fsdp2 cannot "
                "shard: declare it with shape [1] in the model (or use --shard-engine "
                "fairscale on CUDA)")


def sharded_together(unit: ShardUnit) -> bool:
    """Whether ``unit``'s modules are already sharded, all as one FSDP2 unit; a unit
    sharded otherwise (some of its modules, or in other groups) is an error of the plan."""
    sharded = [module for module in unit.modules if isinstance(module, FSDPModule)]
    if not sharded:
        return False
    # the FSDP2 units they belong to, each as the modules it was made of
    groups = {frozenset(map(id, module._get_fsdp_state()._modules))  # type: ignore[operator]
              for module in sharded}
    if groups != {frozenset(map(id, unit.modules))}:
        raise RuntimeError(f"unit {unit.name}: the layers sharded while fairseq built the "
                           "model were grouped otherwise than the wrap policy's plan groups "
                           "them (a defect of the plugin: please report it)")
    return True


def shard_unit(
    unit: ShardUnit, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, offload: OffloadPolicy
) -> None:
    """``fully_shard`` one unit (its modules together); a unit already sharded (layers
    sharded as fairseq built them, by this function with this unit's settings) is left."""
    if sharded_together(unit):
        return
    warnings.filterwarnings("ignore", message=_HARMLESS_VIEW_OUTPUTS, category=UserWarning)
    target = unit.modules[0] if len(unit.modules) == 1 else list(unit.modules)
    fully_shard(target, mesh=mesh, reshard_after_forward=unit.reshard_after_forward,
                mp_policy=mp_policy, offload_policy=offload)


def apply_plan(
    plan: ShardingPlan,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload: bool = False,
    vocabulary_mp_policy: MixedPrecisionPolicy | None = None,
) -> None:
    """Shard every unit of ``plan`` in place, inner units first, then the root.

    ``mp_policy`` casts gathered parameters for compute; the shards stay in their dtype.
    ``vocabulary_mp_policy``, if given, replaces it for vocabulary units.
    With ``offload`` the shards (and their gradients) are kept on CPU.
    """
    refuse_scalar_parameters(plan.root.modules[0])
    mp_policy = mp_policy or MixedPrecisionPolicy()
    policy = offload_policy(offload, mesh)
    for unit in plan.units:
        use_vocabulary_policy = unit.vocabulary and vocabulary_mp_policy is not None
        shard_unit(unit, mesh, vocabulary_mp_policy if use_vocabulary_policy else mp_policy,
                    policy)
    shard_unit(plan.root, mesh, mp_policy, policy)


@contextlib.contextmanager
def gathered(plan: ShardingPlan) -> Iterator[None]:
    """Every unit of ``plan`` gathered until exit and not freed after forwards, so that the
    forward of any submodule runs without collectives.

    Generation in validation (``--eval-bleu``) needs this: fairseq's sequence generator
    calls the encoder and decoder directly, never the model, so the root unit (final layer
    norms, positions) would stay sharded; and ranks decode different numbers of steps, so
    per-layer all-gathers would not pair up across ranks. Costs one gathered model copy in
    the compute dtype while it lasts.
    """
    units = (*plan.units, plan.root)
    for unit in units:
        for module in unit.modules:
            module.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
            module.unshard()  # type: ignore[operator]
    try:
        yield
    finally:
        for unit in units:
            for module in unit.modules:
                module.set_reshard_after_forward(  # type: ignore[operator]
                    unit.reshard_after_forward, recurse=False)
                module.reshard()  # type: ignore[operator]
