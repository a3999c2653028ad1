"""Full tensors cut into this rank's shards (``sharding/full_state.shard_like``), the way a
full checkpoint loads into a sharded model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from launching.harness import run_command

HELPER = Path(__file__).resolve().parent / "helpers" / "shard_like_equivalence.py"


def test_each_rank_cuts_the_slice_torch_would_in_memory_of_its_own() -> None:
    """shard_like cuts the slice where the full tensor is, so that only the slice moves to
    the device; the slices are torch's own (``distribute_tensor``) on every rank of 1-4
    ranks and of a 2 x 2 hybrid mesh, for shapes with dim 0 of 0, 1, below the ranks and
    not a multiple of them, and none shares the full tensor's memory."""
    completed = run_command([sys.executable, str(HELPER)])
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["checked"] == 98 and report["problems"] == [], report["problems"][:5]
