"""``fairseq-shard-verify``: which checkpoints of a save dir are intact, to choose the one to
resume from (``--restore-file``) after a crash or a bad disk.

Each file is checked as a resume would check it, without building a model: it must load
with ``weights_only=True``; a full checkpoint's zip entries must match their CRC-32s; a
sharded index's shard directory must hold DCP's metadata, every tensor and shard files of
the recorded sizes and CRC-32s. One line per file: ``ok`` with its update and epoch, or the
problem. The exit code is 1 when any file is damaged.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
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


def _position(state: Any) -> str:
    """``update N, epoch E`` as fairseq stored them (``?`` where absent)."""
    history = state.get("optimizer_history") or [{}]
    iterator = (state.get("extra_state") or {}).get("train_iterator") or {}
    return (f"update {history[-1].get('num_updates', '?')}, "
            f"epoch {iterator.get('epoch', '?')}")


def check(path: Path) -> tuple[bool, str]:
    """(intact, one line) for one checkpoint file."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        return False, describe_unreadable(path, error)
    if not isinstance(state, dict) or "model" not in state:
        return False, f"{path}: not a fairseq checkpoint (no 'model')"
    if is_sharded_index(state):
        try:
            read_shard_metadata(path, state)
        except ShardedCheckpointError as error:
            return False, str(error)
        return True, f"{path}: ok (sharded, {_position(state)})"
    damaged = damaged_zip_entries(path)
    if damaged:
        return False, corruption_message(path, damaged)
    return True, f"{path}: ok (full, {_position(state)})"


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
    args = parser.parse_args(argv)
    allow_fairseq_checkpoint_types()
    try:
        files = checkpoint_files(args.sources)
    except FileNotFoundError as error:
        sys.exit(f"{PROG}: error: {error}")
    if not files:
        sys.exit(f"{PROG}: error: no *.pt checkpoints in {', '.join(args.sources)}")
    results = [check(path) for path in files]
    for _, line in results:
        print(line)
    damaged = sum(not intact for intact, _ in results)
    if damaged:
        print(f"{damaged} of {len(results)} checkpoints cannot be resumed from")
        sys.exit(1)


if __name__ == "__main__":
    main()
