"""``fairseq-shard-verify``: which checkpoints can be resumed from (:mod:`..checkpoint.verify`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from fairseq_shard_plugin.checkpoint.safe_loading import allow_fairseq_checkpoint_types
from fairseq_shard_plugin.checkpoint.verify import PROG, check, checkpoint_files


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Check fairseq checkpoints (full or sharded, with or without "
        "the plugin) for truncation and corruption, without loading a model.")
    parser.add_argument("sources", nargs="+", help="save dirs (every *.pt) or checkpoint files")
    parser.add_argument("--newest", action="store_true",
                        help="print only the intact checkpoint with optimizer state (one to resume "
                        "from, not an export) with the most updates")
    args = parser.parse_args(argv)
    allow_fairseq_checkpoint_types()
    try:
        files = checkpoint_files(args.sources)
    except FileNotFoundError as error:
        sys.exit(f"{PROG}: error: {error}")
    if not files:
        sys.exit(f"{PROG}: error: no *.pt checkpoints in {', '.join(args.sources)}")
    if not args.newest:
        _list(files)
        return
    verdicts = [check(path) for path in files]
    intact = [verdict for verdict in verdicts if verdict.resumable]
    if not intact:
        sys.exit(f"{PROG}: error: no intact checkpoint with optimizer state among "
                 f"{len(verdicts)}")
    # among equals (fairseq copies one save to several names) checkpoint_last wins
    print(max(intact, key=lambda verdict: (
        verdict.updates, verdict.path.name.startswith("checkpoint_last"))).path)


def _list(files: list[Path]) -> None:
    """One line per file, each printed as soon as it is checked; exit code 1 if any is
    damaged."""
    damaged = 0
    for path in files:
        verdict = check(path)
        print(verdict.line, flush=True)
        damaged += not verdict.intact
    if damaged:
        print(f"{damaged} of {len(files)} checkpoints cannot be resumed from")
        sys.exit(1)


if __name__ == "__main__":
    main()
