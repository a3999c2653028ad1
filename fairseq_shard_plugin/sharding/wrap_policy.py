"""Engine-independent wrap policy: which modules of a fairseq model form sharding units.

Units are chosen by module class and by structure, like torch's ``ModuleWrapPolicy``, so
every fairseq model is covered, whatever ``--min-params-to-wrap`` says:

- every transformer encoder and decoder layer is its own unit (``transformer``,
  ``bart``/``mbart``, ``transformer_lm``, ``transformer_align``);
- in models without them, every block of a repeated stack is its own unit: each entry of
  an ``nn.ModuleList`` holding at least two modules with parameters (lightconv's
  ``layers``, fconv's ``convolutions`` and per-layer ``attention``). Not recurrent cells
  (LSTM's decoder ``layers``): a cell runs once per time step, and a unit would gather
  and free its weights at every step; nor a module listed twice (shared weights);
- every recurrent network (``nn.LSTM``, ``nn.GRU``: lstm's encoder) is its own unit: it
  runs once per forward, over the whole sequence;
- vocabulary modules (token embeddings and the decoder's output projection) that share a
  parameter form one unit together, so a tied 256K embedding is sharded once;
- everything else (final layer norms, learned positions, LSTM decoder cells) belongs to
  the root unit.

With ``--layers-per-unit N``, N consecutive layers (or blocks) of one stack form a unit
together (the last unit of a stack takes what is left), never across stacks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch.nn as nn
from fairseq.modules import LearnedPositionalEmbedding
from fairseq.modules.transformer_layer import (
    TransformerDecoderLayerBase,
    TransformerEncoderLayerBase,
)

from fairseq_shard_plugin.errors import ShardingConfigError
from fairseq_shard_plugin.sharding.settings import ReshardPolicy

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
    kept_gathered_because: str = ""  # why it stays gathered whatever the policy says


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


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def stacked_blocks(model: nn.Module) -> set[int]:
    """ids of the blocks of repeated stacks (entries of an ``nn.ModuleList`` that holds at
    least two modules with parameters, each listed once, none a recurrent cell) and of
    recurrent networks."""
    blocks: set[int] = set()
    for module in model.modules():
        if not isinstance(module, nn.ModuleList):
            continue
        entries = [entry for entry in module if entry is not None and _has_parameters(entry)]
        if len(entries) < 2 or len({id(entry) for entry in entries}) < len(entries):
            continue
        blocks.update(id(entry) for entry in entries
                      if not isinstance(entry, nn.RNNCellBase))
    blocks.update(id(module) for module in model.modules() if isinstance(module, nn.RNNBase))
    return blocks


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


def stack_of(name: str) -> str:
    """The stack a layer or block belongs to: its list's name (``encoder.layers.3`` ->
    ``encoder.layers``); the module's own name where it is not in a list."""
    parent, _, index = name.rpartition(".")
    return parent if index.isdigit() else name


def group_name(names: list[str]) -> str:
    """``encoder.layers.0-3`` for consecutive entries of one list; the one name alone."""
    if len(names) == 1:
        return names[0]
    return f"{names[0]}-{names[-1].rpartition('.')[2]}"


def group_layers(layers: list[tuple[str, nn.Module]], per_unit: int
                 ) -> list[list[tuple[str, nn.Module]]]:
    """``layers`` (in model order) in groups of up to ``per_unit`` consecutive ones of the
    same stack."""
    groups: list[list[tuple[str, nn.Module]]] = []
    for name, module in layers:
        last = groups[-1] if groups else None
        if (last is not None and len(last) < per_unit
                and stack_of(last[-1][0]) == stack_of(name)):
            last.append((name, module))
        else:
            groups.append([(name, module)])
    return groups


def build_plan(model: nn.Module, reshard: ReshardPolicy | None = None,
               root_unit_only: bool = False, layers_per_unit: int = 1) -> ShardingPlan:
    """Return the sharding plan for a fairseq model, each unit freeing its gathered
    parameters after forward as ``reshard`` says (see :class:`.settings.ReshardPolicy`).

    ``root_unit_only`` reproduces stock fairseq's plan for layers below
    ``--min-params-to-wrap``: one unit holding everything (for comparisons).
    ``layers_per_unit`` consecutive layers of a stack form one unit.
    """
    reshard = reshard or ReshardPolicy()
    root = ShardUnit("<root>", (model,), reshard_after_forward=reshard.root)
    if root_unit_only:
        return ShardingPlan(units=(), root=root)
    layers: list[tuple[str, nn.Module]] = []
    candidates: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    layer_prefixes: list[str] = []
    has_transformer_layers = any(isinstance(m, LAYER_CLASSES) for m in model.modules())
    blocks = set() if has_transformer_layers else stacked_blocks(model)
    for name, module in model.named_modules(remove_duplicate=True):
        if id(module) in seen or any(name.startswith(p) for p in layer_prefixes):
            continue
        seen.add(id(module))
        if isinstance(module, LAYER_CLASSES) or id(module) in blocks:
            layers.append((name, module))
            layer_prefixes.append(name + ".")
        elif _is_vocabulary_module(name, module) and any(
            p.requires_grad for p in module.parameters()
        ):
            candidates.append((name, module))
    candidates += _tied_to(model, candidates, layer_prefixes)
    layer_units = [
        ShardUnit(group_name([n for n, _ in group]), tuple(m for _, m in group),
                  reshard_after_forward=reshard.layers)
        for group in group_layers(layers, layers_per_unit)
    ]
    vocabulary = []
    for group in _group_by_shared_parameters(candidates):
        modules = tuple(m for _, m in group)
        reader = _reads_weight_outside(model, modules)
        vocabulary.append(ShardUnit(
            "+".join(n for n, _ in group), modules, vocabulary=True,
            reshard_after_forward=reshard.vocabulary and not reader,
            kept_gathered_because=(f"{reader} multiplies by its weight outside the module"
                                   if reader else "")))
    return ShardingPlan(units=tuple(layer_units + vocabulary), root=root)


def _tied_to(model: nn.Module, candidates: list[tuple[str, nn.Module]],
             layer_prefixes: list[str]) -> list[tuple[str, nn.Module]]:
    """Modules outside the layers that hold a vocabulary module's parameter as their own
    under another name (fconv's ``fc3`` with ``--share-input-output-embed``): they join its
    unit, as FSDP requires of modules sharing a parameter (left in the root, the root's
    unit shared it with the vocabulary's)."""
    shared = {id(p) for _, module in candidates for p in module.parameters()}
    taken = {id(module) for _, module in candidates}
    return [(name, module) for name, module in model.named_modules()
            if name and id(module) not in taken
            and not any(name.startswith(prefix) for prefix in layer_prefixes)
            and any(id(p) in shared for p in module.parameters(recurse=False))]


def _reads_weight_outside(model: nn.Module, modules: tuple[nn.Module, ...]) -> str:
    """The name of a decoder that computes its output with the embedding weight of
    ``modules`` directly (fairseq's ``share_input_output_embed`` without an output module:
    ``F.linear(x, self.embed_tokens.weight)`` in the LSTM and LightConv decoders), else "".
    FSDP2 gathers a unit's parameters only around its modules' forwards, so such a unit
    must stay gathered from its forward to its backward (its gradient is still reduced
    once, after both uses)."""
    if not all(isinstance(module, nn.Embedding) for module in modules):
        return ""  # an output module of the unit holds the weight: its forward gathers it
    for name, module in model.named_modules():
        if getattr(module, "share_input_output_embed", False) is True and any(
                getattr(module, "embed_tokens", None) is unit_module for unit_module in modules):
            return name
    return ""


def refuse_adaptive_modules(model: nn.Module) -> None:
    """fairseq's adaptive input and adaptive softmax run each frequency band only for the
    tokens a batch holds, and the adaptive softmax runs in the criterion, after the model's
    forward: ranks would gather different units (a collective mismatch that aborts or
    hangs) or none at all. Refused, named, before anything trains."""
    from fairseq.modules import AdaptiveInput, AdaptiveSoftmax

    for name, module in model.named_modules():
        if isinstance(module, (AdaptiveInput, AdaptiveSoftmax)):
            flag = ("--adaptive-input" if isinstance(module, AdaptiveInput)
                    else "--adaptive-softmax-cutoff")
            raise ShardingConfigError(
                f"{flag} ({name}) runs each frequency band only for the tokens a batch "
                "holds, so ranks would gather different sharding units: not supported with "
                f"--ddp-backend fully_sharded; remove {flag}, or use another --ddp-backend")


def parameter_count(modules: Iterable[nn.Module]) -> int:
    """Elements of the parameters of ``modules``, each parameter counted once (tied ones)."""
    unique = {id(p): p.numel() for module in modules for p in module.parameters()}
    return sum(unique.values())


def describe_plan(plan: ShardingPlan, root_unit_only: bool = False) -> str:
    """The plan in one line: how many units of which kind, and the root's share of the
    parameters (what stays gathered for the whole forward of the root's own modules);
    ``root_unit_only``: the plan was asked to hold no layer units."""
    in_units = parameter_count(m for unit in plan.units for m in unit.modules)
    total = parameter_count(plan.root.modules)
    vocabulary = [unit.name for unit in plan.units if unit.vocabulary]
    blocks = [unit.name for unit in plan.units if not unit.vocabulary]
    parts = [f"{len(blocks)} layer units ({_span(blocks)})" if blocks else "no layer units"]
    if vocabulary:
        parts.append(f"vocabulary units {', '.join(vocabulary)}")
    parts += [f"{unit.name} kept gathered from forward to backward ({unit.kept_gathered_because})"
              for unit in plan.units if unit.kept_gathered_because]
    root_share = 1 - in_units / total if total else 0.0
    line = f"{'; '.join(parts)}; the root unit holds {root_share:.0%} of {total:,} parameters"
    if root_unit_only:
        line += " (--root-unit-only: the whole model is sharded as one unit)"
    elif not blocks:
        line += (" (no transformer layers, repeated blocks or recurrent networks found: "
                 "the rest of the model is sharded as one unit)")
    return line


def _span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}"
