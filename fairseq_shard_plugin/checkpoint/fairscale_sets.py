"""Which files make up a checkpoint of fairseq's own ``--ddp-backend fully_sharded``.

Stock fairseq shards through fairscale. With ``--use-sharded-state`` every rank saves its
own file, ``checkpoint_last-shard0.pt``, ``-shard1.pt``, ...: its slice of each *flat*
parameter (fairscale concatenates a unit's parameters into one 1-D tensor, splits it
evenly over the ranks and pads the last slice), the optimizer state of those slices, and
``fsdp_metadata``, which names the parameters inside each flat one. Without it stock
saves one full file, which carries ``fsdp_metadata`` too. This module finds a set's files
and checks that they are one save of one run, each in its rank's place, before anything
is put together (:mod:`.fairscale_shards`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from functools import lru_cache
from math import prod
from pathlib import Path
from typing import Any

from fairseq_shard_plugin.checkpoint.errors import (
    CheckpointLoadError,
    describe_unreadable,
    first_cause,
)
from fairseq_shard_plugin.checkpoint.integrity import corruption_message, damaged_zip_entries
from fairseq_shard_plugin.checkpoint.reading import read_checkpoint

METADATA_KEY = "fsdp_metadata"  # fairseq's Trainer.state_dict adds it under fully_sharded
_RANK_SUFFIX = re.compile(r"^(?P<stem>.*)-shard(?P<rank>\d+)(?P<extension>\.pt)$")
_MISSING_SHOWN = 3  # missing files named in a message


class FairscaleShardsError(CheckpointLoadError):
    """A set of per-rank files that cannot be put together; the message says why."""


def is_fairscale_state(state: Any) -> bool:
    """Whether ``state`` was saved by stock fairseq under ``--ddp-backend fully_sharded``:
    one rank's file, or (without ``--use-sharded-state``) a full checkpoint whose
    optimizer state fairscale gathered."""
    return isinstance(state, dict) and METADATA_KEY in state


def is_rank_file_state(state: Any) -> bool:
    """Whether ``state`` is one rank's file of stock fairseq's sharded state: its model holds
    slices of flat parameters (a flat one, or one of another shape than its parameter)."""
    if not is_fairscale_state(state) or not isinstance(state.get("model"), dict):
        return False
    try:
        for unit in state[METADATA_KEY]["param_metadata"]:
            for backing, entry in unit["params"].items():
                stored = state["model"].get(slot_key(unit, backing))
                if stored is not None and (len(entry["names"]) > 1
                                           or tuple(stored.shape) != tuple(entry["shapes"][0])):
                    return True
    except (KeyError, IndexError, TypeError, AttributeError):
        return True  # not as fairscale writes it: putting it together says what is wrong
    return False


def slot_key(unit: dict[str, Any], name: str) -> str:
    """``name`` (a unit's flat parameter, or a parameter it holds) under the unit's path:
    its name in the model's state."""
    return f"{unit['fsdp_path']}.{name}" if unit["fsdp_path"] else name


def rank_in_name(filename: str | Path) -> int | None:
    """N of fairseq's ``NAME-shardN.pt``, else None."""
    match = _RANK_SUFFIX.match(os.path.basename(filename))
    return int(match["rank"]) if match else None


def rank_zero_file(filename: str | Path) -> Path | None:
    """``NAME-shard0.pt`` for any ``NAME-shardN.pt``, else None."""
    match = _RANK_SUFFIX.match(os.path.basename(filename))
    return (Path(filename).parent / f"{match['stem']}-shard0{match['extension']}"
            if match else None)


def first_rank_file(filename: str) -> str | None:
    """``X-shard0.pt`` when ``filename`` (``X.pt``) does not exist and that file does: the
    name stock fairseq's ``fully_sharded`` gave the checkpoint the trainer looks for."""
    stem, extension = os.path.splitext(filename)
    first = f"{stem}-shard0{extension}"
    return first if not os.path.exists(filename) and os.path.exists(first) else None


def read_rank_file(path: Path, check_crc: bool = True) -> dict[str, Any]:
    """One rank's file, CRC-checked and read as every checkpoint is (``weights_only=True``);
    a damaged or unreadable one named in one line."""
    damaged = damaged_zip_entries(path, collective=False) if check_crc else []
    if damaged:
        raise FairscaleShardsError(corruption_message(path, damaged))
    try:
        return read_checkpoint(path)
    except Exception as error:
        raise FairscaleShardsError(describe_unreadable(path, error)) from error


def saved_world_size(filename: str | Path, state: dict[str, Any]) -> int:
    """How many ranks saved ``state``, as its config records."""
    distributed = (state.get("cfg") or {}).get("distributed_training") or {}
    size = distributed.get("distributed_world_size")
    if type(size) is not int or size < 1:
        raise FairscaleShardsError(
            f"{filename}: holds stock fully_sharded state but does not record how many ranks "
            f"saved it (cfg.distributed_training.distributed_world_size is {size!r})")
    return size


def set_members(filename: str, state: dict[str, Any],
                read: Callable[[Path], dict[str, Any]] = read_rank_file,
                ) -> tuple[list[Path], list[dict[str, Any]]]:
    """The files of the set ``filename`` (any one of them; ``state`` is its content) and
    their states, rank by rank, checked to be one save: each file in its rank's place
    (the rank it records), the same update count, the same units and parameters."""
    match = _RANK_SUFFIX.match(os.path.basename(filename))
    if match is None:
        raise FairscaleShardsError(
            f"{filename}: holds one rank's share of fairseq's fully_sharded state, but its "
            "name is not fairseq's NAME-shardN.pt, so the other ranks' files cannot be "
            "found: give it back its name")
    world_size = saved_world_size(filename, state)
    directory = Path(filename).parent
    present = {rank_in_name(path) for path in directory.glob(
        f"{_glob_escape(match['stem'])}-shard*{match['extension']}") if path.is_file()}
    if world_size > len(present):  # (a recorded size may be anything: never count up to it)
        missing = [rank for rank in range(min(world_size, len(present) + _MISSING_SHOWN))
                   if rank not in present]
    else:
        missing = [rank for rank in range(world_size) if rank not in present]
    if missing:
        named = ", ".join(f"{match['stem']}-shard{rank}{match['extension']}"
                          for rank in missing[:_MISSING_SHOWN])
        held = sum(1 for rank in present if rank is not None and rank < world_size)
        more = ", ..." if world_size - held > len(missing[:_MISSING_SHOWN]) else ""
        raise FairscaleShardsError(
            f"{filename}: saved by {world_size} ranks, but {directory} holds {held} of their "
            f"files (missing: {named}{more}): every rank's file is needed")
    files = [directory / f"{match['stem']}-shard{rank}{match['extension']}"
             for rank in range(world_size)]
    states = [state if path.samefile(filename) else read(path) for path in files]
    _check_one_save(filename, files, states)
    return files, states


def _glob_escape(text: str) -> str:
    """``text`` with glob's special characters taken literally."""
    return re.sub(r"([*?\[])", r"[\1]", text)


def _check_one_save(filename: str, files: list[Path], states: list[dict[str, Any]]) -> None:
    """A leftover of an earlier run, a file copied under another rank's name or another
    model's file would mix models without an error: refuse each."""
    def updates(rank_state: dict[str, Any]) -> Any:
        history = rank_state.get("optimizer_history") or [{}]
        return history[-1].get("num_updates")

    def recorded_rank(rank_state: dict[str, Any]) -> Any:
        return ((rank_state.get("cfg") or {}).get("distributed_training") or {}).get(
            "distributed_rank")

    units = _units(states[0])
    for rank, (path, rank_state) in enumerate(zip(files, states, strict=True)):
        if not is_rank_file_state(rank_state):
            raise FairscaleShardsError(
                f"{filename}: {path.name} is not one rank's share of a fully_sharded state: "
                "the files are not one set")
        if recorded_rank(rank_state) != rank:
            raise FairscaleShardsError(
                f"{filename}: {path.name} was saved by rank {recorded_rank(rank_state)!r}, not "
                f"rank {rank}: the files are not in their ranks' places")
        if updates(rank_state) != updates(states[0]):
            raise FairscaleShardsError(
                f"{filename}: {path.name} was saved after {updates(rank_state)} updates, "
                f"{files[0].name} after {updates(states[0])}: the files are not one save")
        if _units(rank_state) != units:
            raise FairscaleShardsError(
                f"{filename}: {path.name} describes other units or parameters than "
                f"{files[0].name}: the files are not one model's")
    _check_counts(filename, states)


def _check_counts(filename: str, states: list[dict[str, Any]]) -> None:
    """Each flat parameter's names, shapes and element counts must describe the same
    parameters, and no rank's padding be negative."""
    for unit in states[0][METADATA_KEY]["param_metadata"]:
        for backing, entry in unit["params"].items():
            sizes = [prod(shape) for shape in entry["shapes"]]
            numels = [int(numel) for numel in entry["numels"]]
            if sizes != numels or len(entry["names"]) != len(sizes):
                raise FairscaleShardsError(
                    f"{filename}: the fsdp_metadata of {slot_key(unit, backing)} lists "
                    f"{len(entry['names'])} parameters of {sizes} elements by their shapes and "
                    f"{numels} by their counts")
    for state in states:
        for unit in state[METADATA_KEY]["param_metadata"]:
            for backing, entry in unit["params"].items():
                if int(entry["padding"]) < 0:
                    raise FairscaleShardsError(
                        f"{filename}: the fsdp_metadata of {slot_key(unit, backing)} gives a "
                        f"negative padding, {entry['padding']}")


def _units(state: dict[str, Any]) -> list[tuple[Any, ...]]:
    """What must agree between a set's files: each unit's path and, per flat parameter,
    the names, shapes and counts of the parameters it holds."""
    return [(unit["fsdp_path"], bool(unit.get("no_broadcast_optim_state")),
             [(backing, list(entry["names"]), [tuple(shape) for shape in entry["shapes"]],
               [int(numel) for numel in entry["numels"]])
              for backing, entry in unit["params"].items()])
            for unit in state[METADATA_KEY]["param_metadata"]]


@lru_cache(maxsize=64)
def set_problem(first: Path) -> str | None:
    """Why the set whose rank-0 file is ``first`` cannot be put together (the files, their
    ranks, saves and units; not each file's bytes), or None. Cached: every file of a set
    asks about the same set."""
    try:  # (each file's bytes are verify's own check of that file)
        state = read_rank_file(first, check_crc=False)
        set_members(str(first), state, read=lambda path: read_rank_file(path, check_crc=False))
    except FairscaleShardsError as error:
        return str(error)
    except Exception as error:  # metadata not as fairscale writes it
        return f"{first}: its fully_sharded set cannot be put together: {first_cause(error)}"
    return None
