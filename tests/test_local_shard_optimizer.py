"""fairseq's optimizer on plain local shards steps exactly like it does on DTensors."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from launching.harness import REPO, free_port, tool

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)


def test_local_shard_adam_equals_dtensor_adam_and_keeps_dtensor_state(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    command = [tool("torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
               str(REPO / "tests" / "helpers" / "local_shard_steps.py"), str(report_path)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert completed.returncode == 0, completed.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert report["params_changed"]
    assert report["params_equal"] and report["state_equal"]  # bit-identical
    assert report["state_is_sharded"]
    assert report["reloaded_equal"] == {"dtensor": True, "full": True}
