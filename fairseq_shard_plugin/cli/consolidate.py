"""``fairseq-shard-consolidate``: a standard fairseq checkpoint (model weights) from a run's
checkpoint, full or sharded (:mod:`..checkpoint.consolidate`), or the mean of several
(``--average``, :mod:`..checkpoint.averaging`), written one tensor at a time: the optimizer
state is never read, and the peak host memory is about the largest tensor (per source)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from fairseq_shard_plugin.checkpoint.atomic_files import WriteError
from fairseq_shard_plugin.checkpoint.consolidate import ConsolidateError, export_checkpoints
from fairseq_shard_plugin.checkpoint.safe_loading import allow_fairseq_checkpoint_types

_DTYPES = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="fairseq-shard-consolidate",
        description="Write a standard fairseq checkpoint (model weights, no optimizer state) "
        "from a sharded run's checkpoint, for fairseq-generate and from_pretrained.",
    )
    parser.add_argument("sources", nargs="+", metavar="source",
                        help="save dir (uses checkpoint_last.pt) or checkpoint file; several "
                        "with --average")
    parser.add_argument("out", help="the consolidated checkpoint to write (e.g. model.pt)")
    parser.add_argument("--average", action="store_true",
                        help="write the mean of the sources' weights (as fairseq's "
                        "scripts/average_checkpoints.py), with the first one's config")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--fp16", dest="dtype", action="store_const", const="fp16",
                           help="store floating-point weights in fp16")
    precision.add_argument("--bf16", dest="dtype", action="store_const", const="bf16",
                           help="store floating-point weights in bf16")
    args = parser.parse_args(argv)
    if len(args.sources) > 1 and not args.average:
        sys.exit(f"fairseq-shard-consolidate: error: {len(args.sources)} checkpoints given: "
                 "add --average to export the mean of their weights, or give one")
    if args.average and len(args.sources) < 2:
        sys.exit("fairseq-shard-consolidate: error: --average needs two or more checkpoints")
    allow_fairseq_checkpoint_types()
    try:
        written = export_checkpoints(args.sources, args.out, _DTYPES[args.dtype])
    except (ConsolidateError, WriteError) as error:
        sys.exit(f"fairseq-shard-consolidate: error: {error}")
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
