"""Checkpoints of fairseq's own ``--ddp-backend fully_sharded`` (fairscale FSDP).

With ``--use-sharded-state`` every rank saves its own file, ``checkpoint_last-shard0.pt``,
``-shard1.pt``, ...: its slice of each *flat* parameter (fairscale concatenates a unit's
parameters into one 1-D tensor, splits it evenly over the ranks and pads the last slice),
the optimizer state of those slices, and ``fsdp_metadata``, which names the parameters
inside each flat one. The NLLB recipe trains this way, so a run that switches to the
plugin finds only such files. :func:`consolidated_state` turns the set into what a stock
single-file checkpoint holds: every parameter whole under its own name, and per-parameter
optimizer state in the order of the model's parameters, which the trainer then loads and
shards like any full checkpoint (same moments, same step: the resume continues the run).

Without it, stock saves one full file, also with ``fsdp_metadata``, whose optimizer state
fairscale gathered unit by unit; :func:`in_model_order` re-indexes it in the model's order.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from math import prod
from pathlib import Path
from typing import Any

import torch

from fairseq_shard_plugin.checkpoint.errors import (
    CheckpointLoadError,
    describe_shape_mismatch,
    first_cause,
)
from fairseq_shard_plugin.checkpoint.integrity import corruption_message, damaged_zip_entries
from fairseq_shard_plugin.checkpoint.reading import read_checkpoint

METADATA_KEY = "fsdp_metadata"  # fairseq's Trainer.state_dict adds it under fully_sharded
_RANK_SUFFIX = re.compile(r"^(?P<stem>.*)-shard(?P<rank>\d+)(?P<extension>\.pt)$")

# reads one rank's file (the trainer's safe reader, CRC-checked)
ReadState = Callable[[Path], dict[str, Any]]


class FairscaleShardsError(CheckpointLoadError):
    """A set of per-rank files that cannot be put together; the message says why."""


def is_rank_file_state(state: Any) -> bool:
    """Whether ``state`` is one rank's file of stock fairseq's sharded state: its model holds
    slices of flat parameters (a flat one, or one of another shape than its parameter)."""
    if not is_fairscale_state(state) or not isinstance(state.get("model"), dict):
        return False
    try:
        for unit in state[METADATA_KEY]["param_metadata"]:
            for backing, entry in unit["params"].items():
                stored = state["model"].get(f"{unit['fsdp_path']}.{backing}"
                                            if unit["fsdp_path"] else backing)
                if stored is not None and (len(entry["names"]) > 1
                                           or tuple(stored.shape) != tuple(entry["shapes"][0])):
                    return True
    except (KeyError, IndexError, TypeError, AttributeError):
        return True  # not as fairscale writes it: putting it together says what is wrong
    return False


def is_fairscale_state(state: Any) -> bool:
    """Whether ``state`` was saved by stock fairseq under ``--ddp-backend fully_sharded``:
    one rank's file, or (without ``--use-sharded-state``) a full checkpoint whose
    optimizer state fairscale gathered."""
    return isinstance(state, dict) and METADATA_KEY in state


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
    gathered = [f"{unit['fsdp_path']}.{name}" if unit["fsdp_path"] else name
                for unit in state[METADATA_KEY]["param_metadata"]
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


def rank_in_name(filename: str | Path) -> int | None:
    """N of fairseq's ``NAME-shardN.pt``, else None."""
    match = _RANK_SUFFIX.match(os.path.basename(filename))
    return int(match["rank"]) if match else None


def first_rank_file(filename: str) -> str | None:
    """``X-shard0.pt`` when ``filename`` (``X.pt``) does not exist and that file does: the
    name stock fairseq's ``--use-sharded-state`` gave the checkpoint the trainer looks for."""
    stem, extension = os.path.splitext(filename)
    first = f"{stem}-shard0{extension}"
    return first if not os.path.exists(filename) and os.path.exists(first) else None


def read_rank_file(path: Path) -> dict[str, Any]:
    """Another rank's file, CRC-checked and read as every checkpoint is
    (``weights_only=True``)."""
    damaged = damaged_zip_entries(path, collective=False)
    if damaged:
        raise FairscaleShardsError(corruption_message(path, damaged))
    return read_checkpoint(path)


def modules_shared_by_config(state: dict[str, Any]) -> list[list[str]]:
    """The names of tied parameters that fairscale's metadata cannot tell, from the model's
    config: ``--share-all-embeddings`` makes the encoder's and the decoder's embeddings one
    module, whose weight fairscale records under the encoder's name only. For readers
    without a model (generation, export); the trainer takes the ties from its model."""
    model_cfg = (state.get("cfg") or {}).get("model") or state.get("args")
    shared = (model_cfg.get("share_all_embeddings") if isinstance(model_cfg, dict)
              else getattr(model_cfg, "share_all_embeddings", False))
    return [["encoder.embed_tokens.weight", "decoder.embed_tokens.weight"]] if shared else []


def rank_files(filename: str, world_size: int) -> list[Path]:
    """The ``world_size`` files of the set ``filename`` (any one of them) belongs to."""
    match = _RANK_SUFFIX.match(os.path.basename(filename))
    if match is None:
        raise FairscaleShardsError(
            f"{filename}: holds one rank's share of fairseq's fully_sharded state, but its "
            "name is not fairseq's NAME-shardN.pt, so the other ranks' files cannot be "
            "found: give it back its name")
    directory = Path(filename).parent
    files = [directory / f"{match['stem']}-shard{rank}{match['extension']}"
             for rank in range(world_size)]
    missing = [path.name for path in files if not path.is_file()]
    if missing:
        raise FairscaleShardsError(
            f"{filename}: saved by {world_size} ranks, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing from {directory}: every rank's "
            "file is needed")
    return files


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
        return _consolidated_state(filename, state, read, model_shapes, param_names, tied)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError) as error:
        # metadata or tensors not as fairscale writes them (a damaged or crafted file)
        raise FairscaleShardsError(
            f"{filename}: its fully_sharded set cannot be put together: "
            f"{first_cause(error)}") from error


def _consolidated_state(
    filename: str, state: dict[str, Any], read: ReadState,
    model_shapes: dict[str, torch.Size] | None, param_names: Sequence[str] | None,
    tied: Sequence[Sequence[str]],
) -> dict[str, Any]:
    world_size = _world_size(filename, state)
    files = rank_files(filename, world_size)
    states = [state if path.samefile(filename) else read(path) for path in files]
    _check_same_save(filename, files, states)
    slots = _flat_slots(filename, states)
    whole = {slot.key: slot.whole([rank["model"][slot.key] for rank in states])
             for slot in slots}
    model = {name: tensor for slot in slots for name, tensor in slot.split(whole[slot.key])}
    for name in states[0][METADATA_KEY].get("buffer_names", []):
        if name in states[0]["model"]:  # buffers are replicated: the first rank's
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
    problem = model_shapes is not None and describe_shape_mismatch(
        filename, {name: tuple(tensor.shape) for name, tensor in model.items()}, model_shapes)
    if problem:
        raise FairscaleShardsError(problem)
    result = {key: value for key, value in state.items() if key != METADATA_KEY}
    result["model"] = model
    if param_names is None:
        result.pop("last_optimizer_state", None)
    elif "last_optimizer_state" in state:
        result["last_optimizer_state"] = _per_parameter_optimizer_state(
            filename, [rank["last_optimizer_state"] for rank in states], slots, param_names)
    return result


def _world_size(filename: str, state: dict[str, Any]) -> int:
    cfg = state.get("cfg") or {}
    distributed = cfg.get("distributed_training") or {}
    size = distributed.get("distributed_world_size")
    if not isinstance(size, int) or size < 1:
        raise FairscaleShardsError(
            f"{filename}: holds one rank's share of fairseq's fully_sharded state but does "
            "not record how many ranks saved it (cfg.distributed_training."
            "distributed_world_size)")
    return size


def _check_same_save(filename: str, files: list[Path], states: list[dict[str, Any]]) -> None:
    """Every file must come from the same save: a leftover of an earlier run would mix
    two models."""
    def updates(rank_state: dict[str, Any]) -> Any:
        history = rank_state.get("optimizer_history") or [{}]
        return history[-1].get("num_updates")

    for path, rank_state in zip(files, states, strict=True):
        if not is_rank_file_state(rank_state):
            raise FairscaleShardsError(
                f"{filename}: {path.name} is not one rank's share of a fully_sharded state "
                f"(no {METADATA_KEY}): the files are not one set")
        if updates(rank_state) != updates(states[0]):
            raise FairscaleShardsError(
                f"{filename}: {path.name} was saved after {updates(rank_state)} updates, "
                f"{files[0].name} after {updates(states[0])}: the files are not one save")


class _FlatSlot:
    """One flat parameter of one fairscale unit: where it lies in each rank's model state,
    its padding on each rank, and the parameters it holds."""

    def __init__(self, filename: str, path: str, backing: str,
                 entries: list[dict[str, Any]]) -> None:
        self.filename = filename
        self.key = f"{path}.{backing}" if path else backing
        self.prefix = f"{path}." if path else ""
        self.paddings = [int(entry["padding"]) for entry in entries]
        first = entries[0]
        self.names = [self.prefix + name for name in first["names"]]
        self.shapes = [tuple(shape) for shape in first["shapes"]]
        self.numels = [int(numel) for numel in first["numels"]]
        sizes = [prod(shape) for shape in self.shapes]
        if sizes != self.numels or len(self.names) != len(sizes):
            raise FairscaleShardsError(
                f"{filename}: the fsdp_metadata of {self.key} lists {len(self.names)} "
                f"parameters of {sizes} elements by their shapes and {self.numels} by "
                "their counts")

    def whole(self, slices: list[torch.Tensor]) -> torch.Tensor:
        """The flat parameter (or a state tensor laid out like it) from every rank's slice,
        each rank's padding removed."""
        kept = [piece.reshape(-1)[: piece.numel() - padding]
                for piece, padding in zip(slices, self.paddings, strict=True)]
        return torch.cat(kept)

    def split(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if flat.numel() != sum(self.numels):
            raise FairscaleShardsError(
                f"{self.filename}: {self.key} holds {flat.numel()} elements without padding, "
                f"its parameters {sum(self.numels)}")
        pieces = flat.split(self.numels)
        return [(name, piece.view(shape))
                for name, piece, shape in zip(self.names, pieces, self.shapes, strict=True)]


def _flat_slots(filename: str, states: list[dict[str, Any]]) -> list[_FlatSlot]:
    """Every flat parameter, in the order of the model's ``parameters()`` under fairscale
    (units in module order, each unit's flat parameters in its order), which is the order
    of the optimizer state."""
    units = [rank[METADATA_KEY]["param_metadata"] for rank in states]
    if any(len(rank_units) != len(units[0]) for rank_units in units):
        raise FairscaleShardsError(f"{filename}: the ranks' files describe different units")
    slots = []
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
            f"{len(slots)} flat parameters: add --reset-optimizer to start it afresh")
    by_name: dict[str, dict[str, Any]] = {}
    for index, slot in enumerate(slots):
        entries = [rank["state"].get(index, {}) for rank in saved]
        per_name: dict[str, dict[str, Any]] = {name: {} for name in slot.names}
        for key, value in entries[0].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                flat = slot.whole([entry[key] for entry in entries])
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
