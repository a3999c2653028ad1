"""The plugin's host work per update stays close to stock fairseq's (a CPU proxy for GPU
speed, where each aten operation is a kernel launch and host time): the aten operations
one update dispatches, counted in fresh processes at world size 1 by
``benchmarks/dispatch_ops.py`` (issue 28: the plugin dispatched 1.24x stock's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.dispatch_ops import compare, largest_differences

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)

LIMIT = 1.3  # the goal is 1.1x for fp32 (benchmarks/results/dispatch_ops.md)


def test_operations_per_update_stay_within_1_3x_of_stock(corpus: Path, tmp_path: Path) -> None:
    rows = compare(corpus, tmp_path, updates=7, time_them=False)
    for name, row in rows.items():
        assert row["ops_per_update"] > 1000, (name, row["ops_per_update"])
        assert row["vs_stock"] <= LIMIT, (name, row["vs_stock"],
                                          largest_differences(rows, name, top=6))
    # the gradient norm takes a few foreach operations, not three per parameter
    ours, stock = rows["plugin fsdp2"]["by_op"], rows["stock legacy_ddp"]["by_op"]
    assert ours.get("aten.pow.Tensor_Scalar", 0) < 10 < stock.get(
        "aten.linalg_vector_norm.default", 0)
