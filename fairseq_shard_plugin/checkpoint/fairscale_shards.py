"""Put checkpoints of fairseq's own ``--ddp-backend fully_sharded`` back together.

:func:`consolidated_state` turns a set of per-rank files (``--use-sharded-state``; found
and checked by :mod:`.fairscale_sets`) into what a stock single-file checkpoint holds:
every parameter whole under its own name, and per-parameter optimizer state in the order
of the model's parameters, which the trainer then loads and shards like any full
checkpoint (same moments, same step: the resume continues the run). A full file's
optimizer state, which fairscale gathered unit by unit, is re-indexed in the model's order
by :func:`in_model_order`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fairseq_shard_plugin.checkpoint.errors import describe_shape_mismatch, first_cause
from fairseq_shard_plugin.checkpoint.fairscale_sets import (
    METADATA_KEY,
    FairscaleShardsError,
    set_members,
    slot_key,
)

# reads one rank's file (the trainer's safe reader, CRC-checked)
ReadState = Callable[[Path], dict[str, Any]]
_NOT_AS_FAIRSCALE_WRITES = (KeyError, IndexError, TypeError, ValueError, AttributeError,
                            RuntimeError)


def in_model_order(filename: str, state: dict[str, Any], param_names: Sequence[str]
                   ) -> dict[str, Any]:
    """A full checkpoint of stock ``fully_sharded`` with its optimizer state indexed in the
    order of ``param_names``: fairscale gathers it unit by unit (the root's parameters,
    then each nested unit's), which is the model's order only when the root is the one
    unit. The unit order and the names come from the checkpoint's ``fsdp_metadata``."""
    result = {key: value for key, value in state.items() if key != METADATA_KEY}
    saved = state.get("last_optimizer_state")
    if saved is None:
        return result
    if not isinstance(saved, dict):  # the nllb branch writes -1 into every rank's file but 0's
        raise FairscaleShardsError(
            f"{filename}: holds no optimizer state (fairseq's fully_sharded keeps the "
            "gathered state in rank 0's file, NAME-shard0.pt): restore that file, or add "
            "--reset-optimizer to start the optimizer afresh")
    if saved.get("uncollected_local_ids"):
        raise FairscaleShardsError(
            f"{filename}: fairscale left the optimizer state of some units out of it "
            "(expert layers): add --reset-optimizer to start the optimizer afresh")
    gathered = [slot_key(unit, name) for unit in state[METADATA_KEY]["param_metadata"]
                for entry in unit["params"].values() for name in entry["names"]]
    by_name = {gathered[index]: entry for index, entry in saved.get("state", {}).items()
               if isinstance(index, int) and index < len(gathered)}
    if len(by_name) != len(saved.get("state", {})):
        raise FairscaleShardsError(
            f"{filename}: its optimizer state has entries for {len(saved.get('state', {}))} "
            f"parameters, its fsdp_metadata names {len(gathered)}: add --reset-optimizer "
            "to start the optimizer afresh")
    unknown = [name for name in param_names if name not in by_name]
    if unknown:
        raise FairscaleShardsError(
            f"{filename}: holds no optimizer state for {len(unknown)} of this model's "
            f"parameters (e.g. {unknown[:2]}; its fsdp_metadata names e.g. {gathered[:2]}); "
            "add --reset-optimizer to start the optimizer afresh")
    reordered = {key: value for key, value in saved.items()
                 if key not in ("state", "param_id_map", "uncollected_local_ids")}
    reordered["state"] = {index: by_name[name] for index, name in enumerate(param_names)}
    groups = saved.get("param_groups") or [{}]
    reordered["param_groups"] = [dict(groups[0], params=list(range(len(param_names))))]
    result["last_optimizer_state"] = reordered
    return result


def modules_shared_by_config(state: dict[str, Any]) -> list[list[str]]:
    """The names of tied parameters that fairscale's metadata cannot tell, from the model's
    config: ``--share-all-embeddings`` makes the encoder's and the decoder's embeddings one
    module, whose weight fairscale records under the encoder's name only. For readers
    without a model (generation, export); the trainer takes the ties from its model."""
    model_cfg = (state.get("cfg") or {}).get("model") or state.get("args")
    shared = (model_cfg.get("share_all_embeddings") if isinstance(model_cfg, dict)
              else getattr(model_cfg, "share_all_embeddings", False))
    return [["encoder.embed_tokens.weight", "decoder.embed_tokens.weight"]] if shared else []


def consolidated_state(
    filename: str, state: dict[str, Any], read: ReadState,
    model_shapes: dict[str, torch.Size] | None, param_names: Sequence[str] | None,
    tied: Sequence[Sequence[str]],
) -> dict[str, Any]:
    """The checkpoint ``state`` (one rank's file) with the whole set put together.

    ``read`` reads another rank's file; ``model_shapes`` are the names and shapes of the
    model's state (checked before the optimizer state is put together; None: no model);
    ``param_names`` are the names of the optimizer's parameters in its order (None: the
    optimizer state is left out, for a reset or an export);
    ``tied`` lists the names of each tied parameter (fairscale keeps one of them, and
    records some of the others).
    """
    try:
        _, states = set_members(filename, state, read)
        slots = _flat_slots(filename, states)
        model = _whole_model(states, slots, tied)
    except FairscaleShardsError:
        raise
    except _NOT_AS_FAIRSCALE_WRITES as error:  # metadata or tensors of a damaged/crafted file
        raise FairscaleShardsError(
            f"{filename}: its fully_sharded set cannot be put together: "
            f"{first_cause(error)}") from error
    problem = model_shapes is not None and describe_shape_mismatch(
        filename, {name: tuple(tensor.shape) for name, tensor in model.items()}, model_shapes)
    if problem:
        raise FairscaleShardsError(problem)
    result = {key: value for key, value in state.items() if key != METADATA_KEY}
    result["model"] = model
    if param_names is None:
        result.pop("last_optimizer_state", None)
    elif "last_optimizer_state" in state:
        try:
            result["last_optimizer_state"] = _per_parameter_optimizer_state(
                filename, [rank["last_optimizer_state"] for rank in states], slots,
                param_names)
        except FairscaleShardsError:
            raise
        except _NOT_AS_FAIRSCALE_WRITES as error:
            raise FairscaleShardsError(
                f"{filename}: its optimizer state cannot be put together "
                f"({first_cause(error)}): add --reset-optimizer to start the optimizer "
                "afresh") from error
    return result


def _whole_model(states: list[dict[str, Any]], slots: list[_FlatSlot],
                 tied: Sequence[Sequence[str]]) -> dict[str, torch.Tensor]:
    """Every parameter whole under each of its names, and the buffers."""
    whole = {slot.key: slot.whole([rank["model"][slot.key] for rank in states])
             for slot in slots}
    model = {name: tensor for slot in slots for name, tensor in slot.split(whole[slot.key])}
    flat_keys = {slot.key for slot in slots}
    for name in states[0][METADATA_KEY].get("buffer_names", []):
        if name in states[0]["model"] and name not in flat_keys:  # replicated: rank 0's
            model[name] = states[0]["model"][name]
    for unit in states[0][METADATA_KEY]["param_metadata"]:  # fairscale's own record
        for source, target in unit.get("shared_param_info", []):
            if source in model:
                model.setdefault(target, model[source])
    for names in tied:
        stored = next((model[name] for name in names if name in model), None)
        for name in names:
            if stored is not None and name not in model:
                model[name] = stored
    return model


class _FlatSlot:
    """One flat parameter of one fairscale unit: where it lies in each rank's model state,
    its padding on each rank, and the parameters it holds."""

    def __init__(self, filename: str, path: str, backing: str,
                 entries: list[dict[str, Any]]) -> None:
        self.filename = filename
        self.key = slot_key({"fsdp_path": path}, backing)
        self.prefix = f"{path}." if path else ""
        self.paddings = [int(entry["padding"]) for entry in entries]
        first = entries[0]
        self.names = [self.prefix + name for name in first["names"]]
        self.shapes = [tuple(shape) for shape in first["shapes"]]
        self.numels = [int(numel) for numel in first["numels"]]  # (agreeing: set_members)

    def whole(self, slices: list[torch.Tensor], what: str = "") -> torch.Tensor:
        """The flat parameter (or ``what``, a state tensor laid out like it) from every
        rank's slice, each rank's padding removed."""
        sizes = [piece.numel() for piece in slices]
        if len(set(sizes)) != 1 or any(pad > size for pad, size in zip(self.paddings, sizes,
                                                                            strict=True)):
            raise FairscaleShardsError(
                f"{self.filename}: the ranks' slices of {self.key}{what} hold {sizes} "
                f"elements with padding {self.paddings}: fairscale splits evenly")
        kept = [piece.reshape(-1)[: piece.numel() - padding]
                for piece, padding in zip(slices, self.paddings, strict=True)]
        flat = torch.cat(kept)
        if flat.numel() != sum(self.numels):
            raise FairscaleShardsError(
                f"{self.filename}: {self.key}{what} holds {flat.numel()} elements without "
                f"padding over {len(slices)} ranks, its parameters {sum(self.numels)}")
        return flat

    def split(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        pieces = flat.split(self.numels)
        return [(name, piece.view(shape))
                for name, piece, shape in zip(self.names, pieces, self.shapes, strict=True)]


def _flat_slots(filename: str, states: list[dict[str, Any]]) -> list[_FlatSlot]:
    """Every flat parameter, in the order of the model's ``parameters()`` under fairscale
    (units in module order, each unit's flat parameters in its order), which is the order
    of the optimizer state."""
    units = [rank[METADATA_KEY]["param_metadata"] for rank in states]  # (the same units:
    slots = []  # set_members checked)
    for index, unit in enumerate(units[0]):
        if unit.get("no_broadcast_optim_state"):
            raise FairscaleShardsError(
                f"{filename}: unit {unit['fsdp_path'] or '(root)'} keeps per-rank parameters "
                "(an expert layer): the plugin shards dense models only")
        for backing in unit["params"]:
            entries = [rank_units[index]["params"][backing] for rank_units in units]
            slots.append(_FlatSlot(filename, unit["fsdp_path"], backing, entries))
    for slot in slots:
        for rank, rank_state in enumerate(states):
            if slot.key not in rank_state["model"]:
                raise FairscaleShardsError(
                    f"{filename}: rank {rank}'s file lacks {slot.key}, which its metadata "
                    "names")
    return slots


def _per_parameter_optimizer_state(
    filename: str, saved: list[dict[str, Any]], slots: list[_FlatSlot],
    param_names: Sequence[str],
) -> dict[str, Any]:
    """The ranks' optimizer states of their flat slices as one state per parameter, indexed
    in the order of ``param_names``."""
    groups = saved[0].get("param_groups") or []
    if len(groups) != 1 or len(groups[0].get("params", [])) != len(slots):
        raise FairscaleShardsError(
            f"{filename}: its optimizer state has {len(groups)} parameter groups over "
            f"{sum(len(g.get('params', [])) for g in groups)} parameters, its model "
            f"{len(slots)} flat parameters: add --reset-optimizer to start the optimizer "
            "afresh")
    by_name: dict[str, dict[str, Any]] = {}
    for index, slot in enumerate(slots):
        entries = [rank["state"].get(index, {}) for rank in saved]
        per_name: dict[str, dict[str, Any]] = {name: {} for name in slot.names}
        for key, value in entries[0].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                flat = slot.whole([entry[key] for entry in entries], f"'s {key}")
                for name, piece in slot.split(flat):
                    per_name[name][key] = piece
            else:  # the step count: the same on every rank
                for name in slot.names:
                    per_name[name][key] = (value.clone() if isinstance(value, torch.Tensor)
                                           else value)
        by_name.update(per_name)
    unknown = [name for name in param_names if name not in by_name]
    if unknown:
        raise FairscaleShardsError(
            f"{filename}: holds no optimizer state for {len(unknown)} of this model's "
            f"parameters (e.g. {unknown[:2]}; it holds {len(by_name)} parameters, e.g. "
            f"{sorted(by_name)[:2]}); add --reset-optimizer to start the optimizer afresh")
    result = {key: value for key, value in saved[0].items() if key not in ("state",)}
    result["state"] = {index: by_name[name] for index, name in enumerate(param_names)
                       if by_name[name]}
    result["param_groups"] = [dict(groups[0], params=list(range(len(param_names))))]
    return result
