"""``fairseq-shard-verify``: which checkpoints of a save dir are intact, to choose the one to
resume from (``--restore-file``) after a crash or a bad disk.

Each file is checked as a resume would check it, without building a model: it must load
with ``weights_only=True``; a full checkpoint's zip entries must match their CRC-32s; a
sharded index's shard directory must hold DCP's metadata, every tensor and shard files of
the recorded sizes and CRC-32s. One line per file: ``ok`` with its update and epoch, or the
problem; an intact file without optimizer state is said to be an export, not a checkpoint to
resume from. The exit code is 1 when any file is damaged. With ``--newest`` it prints only
the path of the resumable checkpoint with the most updates, for a resume script's
``--restore-file``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fairseq_shard_plugin.checkpoint.errors import describe_unreadable
from fairseq_shard_plugin.checkpoint.fairscale_sets import (
    is_rank_file_state,
    rank_in_name,
    rank_zero_file,
    set_problem,
)
from fairseq_shard_plugin.checkpoint.integrity import corruption_message, damaged_zip_entries
from fairseq_shard_plugin.checkpoint.reading import read_checkpoint
from fairseq_shard_plugin.checkpoint.safe_loading import allow_fairseq_checkpoint_types
from fairseq_shard_plugin.checkpoint.sharded import (
    ShardedCheckpointError,
    is_sharded_index,
    read_shard_metadata,
)

PROG = "fairseq-shard-verify"


@dataclass(frozen=True)
class Verdict:
    path: Path
    intact: bool
    line: str  # "PATH: ok (...)" or the problem
    updates: int = -1  # fairseq's update count, where intact and recorded
    resumable: bool = False  # intact, with optimizer state (not an export for inference)


def _position(state: Any) -> tuple[int, str]:
    """The update count and ``update N, epoch E`` as fairseq stored them (``?`` if absent)."""
    updates = (state.get("optimizer_history") or [{}])[-1].get("num_updates")
    epoch = ((state.get("extra_state") or {}).get("train_iterator") or {}).get("epoch", "?")
    return (-1 if updates is None else int(updates),
            f"update {'?' if updates is None else updates}, epoch {epoch}")


def _rank_file_kind(path: Path, state: dict[str, Any]) -> str:
    """How one rank's file of stock ``fully_sharded``'s state is described: which rank of
    how many (every file of the set is needed: :func:`check` also judges the set)."""
    ranks = ((state.get("cfg") or {}).get("distributed_training") or {}).get(
        "distributed_world_size", "?")
    rank = rank_in_name(path)
    return f"rank {'?' if rank is None else rank} of {ranks} of fairseq's fully_sharded state"


def check(path: Path) -> Verdict:
    """The verdict on one checkpoint file."""
    allow_fairseq_checkpoint_types()
    try:
        state = read_checkpoint(path)
    except Exception as error:
        return Verdict(path, False, describe_unreadable(path, error))
    if not isinstance(state, dict) or "model" not in state:
        return Verdict(path, False, f"{path}: not a fairseq checkpoint (no 'model')")
    if not isinstance(state["model"], dict):
        return Verdict(path, False, f"{path}: not a fairseq checkpoint (its 'model' is a "
                       f"{type(state['model']).__name__}, not a dict of tensors)")
    if is_sharded_index(state):
        try:
            read_shard_metadata(path, state)
        except ShardedCheckpointError as error:
            return Verdict(path, False, str(error))
        kind = "sharded"
    else:
        damaged = damaged_zip_entries(path)
        if damaged:
            return Verdict(path, False, corruption_message(path, damaged))
        kind = "full"
        if is_rank_file_state(state):
            kind = _rank_file_kind(path, state)
            first = rank_zero_file(path)
            problem = set_problem(first) if first is not None and first.is_file() else (
                f"{path}: one rank's share of fairseq's fully_sharded state without its "
                "set's NAME-shard0.pt beside it")
            if problem:
                return Verdict(path, False, problem)
    updates, position = _position(state)
    if "last_optimizer_state" not in state:
        return Verdict(path, True, f"{path}: ok ({kind}, {position}; no optimizer state: an "
                       "export for inference, not a checkpoint to resume from)", updates)
    return Verdict(path, True, f"{path}: ok ({kind}, {position})", updates, resumable=True)


def checkpoint_files(sources: Sequence[str]) -> list[Path]:
    """The files named, and every ``*.pt`` of the directories named."""
    files: list[Path] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            files.extend(sorted(p for p in path.glob("*.pt") if p.is_file()))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
    return files
