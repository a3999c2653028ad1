"""Apply a sharding plan with fairscale's ``FullyShardedDataParallel`` (flat parameters).

For environments pinned to fairscale. Each unit of the plan becomes one fairscale FSDP
instance with ``flatten_parameters=True`` (inner units first, the root last), so a rank
holds 1/N of one flat fp32 tensor per unit. fairscale runs forward and backward on CUDA
streams: training needs CUDA (``validation.py`` refuses it otherwise), while construction
works on CPU with ``compute_device=cpu``, which is how the structure is tested.

Tied vocabulary: fairscale FSDP wraps exactly one module, but the plan's vocabulary unit
holds the token embedding and the output projection that shares its weight. Wrapping only
the embedding would leave the projection holding the old parameter, which the root would
then shard a second time and train separately (the tie broken). Instead the embedding is
the unit's one module, turned into a :class:`TiedEmbedding` (``forward(x, project=True)``
computes ``x @ W.T``), and the projection is replaced by a parameter-free
:class:`TiedOutputProjection` that calls the embedding's FSDP instance in projection mode.
Every use of the weight therefore goes through that instance's forward, which gathers it;
autograd sums the uses into the one flat gradient; the weight is sharded once. The
projection's checkpoint key (``decoder.output_projection.weight``) is written and skipped
on load by :class:`ShardedRoot`, so checkpoints keep fairseq's standard keys.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fairscale.nn.checkpoint import checkpoint_wrapper
from fairscale.nn.data_parallel import FullyShardedDataParallel

from fairseq_shard_plugin.errors import ShardingConfigError
from fairseq_shard_plugin.sharding.wrap_policy import (
    LAYER_CLASSES,
    ShardingPlan,
    ShardUnit,
    is_linear_layer,
)


@dataclass(frozen=True)
class FairscaleSettings:
    """fairscale FSDP arguments, mapped from the same flags as the FSDP2 engine."""

    compute_device: torch.device
    compute_dtype: torch.dtype | None = None  # --fp16/--memory-efficient-fp16 or --bf16
    sixteen_bit_parameters: bool = False  # --memory-efficient-*: the shards are 16-bit
    reduce_in_16_bit: bool = False  # --reduce-in-16-bit: no fp32_reduce_scatter
    checkpoint_activations: bool = False  # --checkpoint-activations
    offload_activations: bool = False  # --offload-activations

    def fsdp_kwargs(self, reshard_after_forward: bool) -> dict[str, Any]:
        # fp32 shards cast for compute, or (memory-efficient flags) 16-bit shards computed
        # as they are, whose gradients fairscale can only reduce in their own dtype
        mixed = self.compute_dtype is not None and not self.sixteen_bit_parameters
        return {
            "reshard_after_forward": reshard_after_forward,
            # fairscale keeps the root gathered unless told otherwise; the plan decides.
            "disable_reshard_on_root": not reshard_after_forward,
            "flatten_parameters": True,
            "mixed_precision": mixed,
            "compute_dtype": self.compute_dtype,
            # fp32 shards are the masters; their gradients reduce in fp32 unless asked not to
            "fp32_reduce_scatter": mixed and not self.reduce_in_16_bit,
            "compute_device": self.compute_device,
        }


class TiedEmbedding(nn.Embedding):
    """A token embedding that is also the output projection sharing its weight."""

    def forward(self, input: torch.Tensor, project: bool = False) -> torch.Tensor:
        if project:
            return F.linear(input, self.weight)
        return super().forward(input)


class TiedOutputProjection(nn.Module):
    """Parameter-free stand-in for an output projection tied to a sharded embedding.

    The embedding's FSDP instance is held outside ``_modules`` (it is registered where
    the embedding lives), so its parameters are neither listed nor sharded twice.
    """

    def __init__(self, vocabulary: FullyShardedDataParallel, in_features: int,
                 out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._vocabulary = (vocabulary,)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self._vocabulary[0](features, project=True)


class ShardedRoot(FullyShardedDataParallel):
    """The root unit, with fairseq's model-loading signature and the tied checkpoint keys.

    ``state_dict()`` is fairscale's full (gathered, fp32) state dict, a collective.
    """

    def __init__(self, module: nn.Module, tied_keys: dict[str, str], **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        self.tied_keys = tied_keys  # output projection key -> embedding key

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        state = super().state_dict(*args, **kwargs)
        for projection_key, embedding_key in self.tied_keys.items():
            if embedding_key in state:
                state[projection_key] = state[embedding_key]
        return state

    def load_state_dict(self, state_dict: Any, strict: bool = True, model_cfg: Any = None) -> Any:
        state = {k: v for k, v in state_dict.items() if k not in self.tied_keys}
        return super().load_state_dict(state, strict)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        """fairseq enters this for all but the last micro-batch of ``--update-freq``; under
        fairscale every rank would then hold full-size gradients until the last one. The
        shards reduce-scatter every micro-batch instead (fairseq's own choice for FSDP)."""
        return contextlib.nullcontext()


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def _replace_everywhere(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put ``new`` wherever ``old`` is registered (a shared embedding has several parents)."""
    for parent in list(root.modules()):
        for child_name, child in list(parent.named_children()):
            if child is old:
                setattr(parent, child_name, new)


def _tied_parts(unit: ShardUnit, model: nn.Module) -> tuple[nn.Embedding, list[str], str]:
    """The unit's embedding, the names of the projections tied to it, and its name."""
    names = dict((id(m), n) for n, m in model.named_modules())
    embeddings = [m for m in unit.modules if type(m) is nn.Embedding]
    projections = [m for m in unit.modules if is_linear_layer(m)]
    if len(embeddings) != 1 or len(projections) != len(unit.modules) - 1 or any(
        p.weight is not embeddings[0].weight or getattr(p, "bias", None) is not None
        for p in projections
    ):
        raise ShardingConfigError(
            f"--shard-engine fairscale cannot shard the tied unit {unit.name}: it needs one "
            "nn.Embedding and bias-free nn.Linear projections sharing its weight; "
            "use --shard-engine fsdp2"
        )
    return embeddings[0], [names[id(p)] for p in projections], names[id(embeddings[0])]


def _wrap_unit(unit: ShardUnit, model: nn.Module, settings: FairscaleSettings,
               tied_keys: dict[str, str]) -> None:
    kwargs = settings.fsdp_kwargs(unit.reshard_after_forward)
    if len(unit.modules) == 1:
        module = unit.modules[0]
        if settings.checkpoint_activations and isinstance(module, LAYER_CLASSES):
            apply_activation_checkpointing(module, settings.offload_activations)
        _replace_everywhere(model, module, FullyShardedDataParallel(module, **kwargs))
        return
    embedding, projection_names, embedding_name = _tied_parts(unit, model)
    embedding.__class__ = TiedEmbedding
    vocabulary = FullyShardedDataParallel(embedding, **kwargs)
    _replace_everywhere(model, embedding, vocabulary)
    for name in projection_names:
        _set_submodule(model, name, TiedOutputProjection(
            vocabulary, embedding.embedding_dim, embedding.num_embeddings))
        tied_keys[f"{name}.weight"] = f"{embedding_name}.weight"


def apply_activation_checkpointing(layer: nn.Module, offload_to_cpu: bool) -> None:
    """Checkpoint ``layer`` with fairscale's ``checkpoint_wrapper``, inside its FSDP unit.

    fairseq's ``--checkpoint-activations`` has already patched the layer's ``forward`` with
    fairseq's own wrapper. fairscale's wrapper calls the class's ``forward``, so applying
    it replaces fairseq's patch rather than nesting it: one level of checkpointing, whose
    recomputation runs in backward after the unit's pre-backward hook gathered the layer.
    """
    if hasattr(layer, "precheckpoint_forward"):
        del layer.precheckpoint_forward  # fairseq's marker; its patched forward goes next
    checkpoint_wrapper(layer, offload_to_cpu=offload_to_cpu)


def apply_plan(plan: ShardingPlan, settings: FairscaleSettings) -> ShardedRoot:
    """Wrap every unit of ``plan`` in fairscale FSDP, inner units first; return the root."""
    model = plan.root.modules[0]
    model.to(settings.compute_device)  # fairscale shards parameters where they are
    tied_keys: dict[str, str] = {}
    for unit in plan.units:
        _wrap_unit(unit, model, settings, tied_keys)
    return ShardedRoot(model, tied_keys, **settings.fsdp_kwargs(plan.root.reshard_after_forward))


def _is_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "_is_sharded", False))


def flat_shard(param: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """fairscale's gradients, for :func:`.gradients.global_grad_norm`: a flat shard (its
    padding holds zero gradient) on one rank each, or a whole unsharded gradient."""
    return grad, 1 if _is_sharded(param) else None


def _local_shard(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's padded slice of a flat tensor, as fairscale slices its flat parameters."""
    chunks = full.flatten().chunk(world)
    size = chunks[0].numel()
    mine = chunks[rank] if rank < len(chunks) else full.new_empty(0)
    return F.pad(mine, [0, size - mine.numel()]).clone()


def _ordered_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state with every per-element tensor of a flat shard gathered whole.

    Tensors keep the flat-parameter layout (unpadded), so the file does not depend on the
    world size; a collective, called by every rank.
    """
    world = dist.get_world_size()
    per_param = dict(state["state"])
    for index, param in enumerate(_ordered_params(optimizer)):
        if not _is_sharded(param) or index not in per_param:
            continue
        entry = dict(per_param[index])
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                pieces = [torch.empty_like(value) for _ in range(world)]
                dist.all_gather(pieces, value.contiguous())
                entry[key] = torch.cat(pieces)[: param._orig_size.numel()].cpu()
        per_param[index] = entry
    return {**state, "state": per_param}


def shard_loaded_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After loading a full optimizer state, keep this rank's slice of each flat tensor."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for param in _ordered_params(optimizer):
        if not _is_sharded(param):
            continue
        state = optimizer.state.get(param, {})
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel() == param._orig_size.numel():
                state[key] = _local_shard(value, world, rank).to(param.device, value.dtype)


def full_model_state(model_state: dict[str, Any]) -> dict[str, Any]:
    """fairscale's root already returns full fp32 tensors; keep them on the CPU."""
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in model_state.items()}
