"""Engine-independent wrap policy: which modules of a fairseq model form sharding units.

Units are chosen by module class, like torch's ``ModuleWrapPolicy``, so every fairseq
model built from transformer layers is covered (``transformer``, ``bart``/``mbart``,
``transformer_lm``), whatever ``--min-params-to-wrap`` says:

- every encoder and decoder layer is its own unit;
- vocabulary modules (token embeddings and the decoder's output projection) that share a
  parameter form one unit together, so a tied 256K embedding is sharded once;
- everything else (final layer norms, learned positions) belongs to the root unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
from fairseq.modules import LearnedPositionalEmbedding
from fairseq.modules.transformer_layer import (
    TransformerDecoderLayerBase,
    TransformerEncoderLayerBase,
)

LAYER_CLASSES: tuple[type[nn.Module], ...] = (
    TransformerEncoderLayerBase,
    TransformerDecoderLayerBase,
)
OUTPUT_PROJECTION_NAME = "output_projection"


@dataclass(frozen=True)
class ShardUnit:
    """Modules sharded and gathered together, and whether to free them after forward."""

    name: str
    modules: tuple[nn.Module, ...]
    reshard_after_forward: bool = True
    vocabulary: bool = False  # token embeddings / output projection (the largest unit)


@dataclass(frozen=True)
class ShardingPlan:
    """Units in the order they must be applied: inner units first, the root last."""

    units: tuple[ShardUnit, ...]
    root: ShardUnit


def is_linear_layer(module: nn.Module) -> bool:
    """An ``nn.Linear``, or a module that is one in all but class: fairseq's nllb branch
    builds its projections (the output projection included) as
    ``fairseq.modules.linear.Linear``, a plain ``nn.Module`` with a 2-D weight and a bias."""
    if isinstance(module, nn.Linear):
        return True
    weight = getattr(module, "weight", None)
    return (not isinstance(module, nn.Embedding) and isinstance(weight, nn.Parameter)
            and weight.dim() == 2 and next(module.children(), None) is None)


def _is_vocabulary_module(name: str, module: nn.Module) -> bool:
    if isinstance(module, nn.Embedding):
        return not isinstance(module, LearnedPositionalEmbedding)
    return is_linear_layer(module) and name.rsplit(".", 1)[-1] == OUTPUT_PROJECTION_NAME


def _group_by_shared_parameters(
    candidates: list[tuple[str, nn.Module]],
) -> list[list[tuple[str, nn.Module]]]:
    """Group modules that share any parameter object (tied embeddings)."""
    groups: list[tuple[set[int], list[tuple[str, nn.Module]]]] = []
    for name, module in candidates:
        param_ids = {id(p) for p in module.parameters()}
        members = [(name, module)]
        for group in [g for g in groups if g[0] & param_ids]:
            groups.remove(group)
            param_ids |= group[0]
            members = group[1] + members
        groups.append((param_ids, members))
    return [members for _, members in groups]


def build_plan(
    model: nn.Module, keep_root_gathered: bool = False, root_unit_only: bool = False,
    keep_vocabulary_gathered: bool = False, keep_all_gathered: bool = False,
) -> ShardingPlan:
    """Return the sharding plan for a fairseq model.

    ``root_unit_only`` reproduces stock fairseq's plan for layers below
    ``--min-params-to-wrap``: one unit holding everything (for comparisons).
    ``keep_vocabulary_gathered`` leaves the vocabulary units gathered after forward: they
    are used several times (encoder and decoder embeddings, output projection), and each
    use of a resharded unit is another all-gather, in forward and again in backward.
    ``keep_all_gathered`` (fairseq's ``--no-reshard-after-forward``, "ZeRO-2") leaves every
    unit gathered from its forward until its backward: no all-gathers in backward, the whole
    model's gathered copy at the peak.
    """
    keep_root_gathered = keep_root_gathered or keep_all_gathered
    keep_vocabulary_gathered = keep_vocabulary_gathered or keep_all_gathered
    root = ShardUnit("<root>", (model,), reshard_after_forward=not keep_root_gathered)
    if root_unit_only:
        return ShardingPlan(units=(), root=root)
    layers: list[ShardUnit] = []
    candidates: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    layer_prefixes: list[str] = []
    for name, module in model.named_modules(remove_duplicate=True):
        if id(module) in seen or any(name.startswith(p) for p in layer_prefixes):
            continue
        seen.add(id(module))
        if isinstance(module, LAYER_CLASSES):
            layers.append(ShardUnit(name, (module,),
                                    reshard_after_forward=not keep_all_gathered))
            layer_prefixes.append(name + ".")
        elif _is_vocabulary_module(name, module) and any(
            p.requires_grad for p in module.parameters()
        ):
            candidates.append((name, module))
    vocabulary = [
        ShardUnit("+".join(n for n, _ in group), tuple(m for _, m in group), vocabulary=True,
                  reshard_after_forward=not keep_vocabulary_gathered)
        for group in _group_by_shared_parameters(candidates)
    ]
    return ShardingPlan(units=tuple(layers + vocabulary), root=root)
