"""``fairseq-shard-verify``: which checkpoints of a save dir are intact, to choose the one to
resume from (``--restore-file``) after a crash or a bad disk.

Each file is checked as a resume would check it, without building a model: it must load
with ``weights_only=True``; a full checkpoint's zip entries must match their CRC-32s; a
sharded index's shard directory must hold DCP's metadata, every tensor and shard files of
the recorded sizes and CRC-32s. One line per file: ``ok`` with its update and epoch, or the
problem. The exit code is 1 when any file is damaged. With ``--newest`` it prints only the
path of the intact checkpoint with the most updates, for a resume script's
``--restore-file``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fairseq_shard_plugin.checkpoint_errors import describe_unreadable
from fairseq_shard_plugin.checkpoint_integrity import corruption_message, damaged_zip_entries
from fairseq_shard_plugin.checkpoint_sharded import (
    ShardedCheckpointError,
    is_sharded_index,
    read_shard_metadata,
)
from fairseq_shard_plugin.safe_loading import allow_fairseq_checkpoint_types

PROG = "fairseq-shard-verify"


@dataclass(frozen=True)
class Verdict:
    path: Path
    intact: bool
    line: str  # "PATH: ok (...)" or the problem
    updates: int = -1  # fairseq's update count, where intact and recorded


def _position(state: Any) -> tuple[int, str]:
    """The update count and ``update N, epoch E`` as fairseq stored them (``?`` if absent)."""
    updates = (state.get("optimizer_history") or [{}])[-1].get("num_updates")
    epoch = ((state.get("extra_state") or {}).get("train_iterator") or {}).get("epoch", "?")
    return (-1 if updates is None else int(updates),
            f"update {'?' if updates is None else updates}, epoch {epoch}")


def check(path: Path) -> Verdict:
    """The verdict on one checkpoint file."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        return Verdict(path, False, describe_unreadable(path, error))
    if not isinstance(state, dict) or "model" not in state:
        return Verdict(path, False, f"{path}: not a fairseq checkpoint (no 'model')")
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
    updates, position = _position(state)
    return Verdict(path, True, f"{path}: ok ({kind}, {position})", updates)


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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Check fairseq checkpoints (full or sharded, with or without "
        "the plugin) for truncation and corruption, without loading a model.")
    parser.add_argument("sources", nargs="+", help="save dirs (every *.pt) or checkpoint files")
    parser.add_argument("--newest", action="store_true",
                        help="print only the intact checkpoint with the most updates")
    args = parser.parse_args(argv)
    allow_fairseq_checkpoint_types()
    try:
        files = checkpoint_files(args.sources)
    except FileNotFoundError as error:
        sys.exit(f"{PROG}: error: {error}")
    if not files:
        sys.exit(f"{PROG}: error: no *.pt checkpoints in {', '.join(args.sources)}")
    verdicts = [check(path) for path in files]
    if args.newest:
        intact = [verdict for verdict in verdicts if verdict.intact]
        if not intact:
            sys.exit(f"{PROG}: error: no intact checkpoint among {len(verdicts)}")
        # among equals (fairseq copies one save to several names) checkpoint_last wins
        print(max(intact, key=lambda verdict: (
            verdict.updates, verdict.path.name.startswith("checkpoint_last"))).path)
        return
    for verdict in verdicts:
        print(verdict.line)
    damaged = sum(not verdict.intact for verdict in verdicts)
    if damaged:
        print(f"{damaged} of {len(verdicts)} checkpoints cannot be resumed from")
        sys.exit(1)


if __name__ == "__main__":
    main()
