"""fairseq's optimizer on plain local shards steps exactly like it does on DTensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launching.harness import REPO, run_helper

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)


def test_local_shard_adam_equals_dtensor_adam_and_keeps_dtensor_state(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    run_helper(REPO / "tests" / "helpers" / "local_shard_steps.py", str(report_path))
    report = json.loads(report_path.read_text())
    assert report["params_changed"]
    assert report["params_equal"] and report["state_equal"]  # bit-identical
    assert report["state_is_sharded"]
    assert report["reloaded_equal"] == {"dtensor": True, "full": True}
