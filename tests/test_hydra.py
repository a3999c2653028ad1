"""fairseq-hydra-train with the plugin's configs and command-line overrides."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from benchmarks.harness import PLUGIN_DIR, REPO, free_port, parse_logs, tool

CONFIGS = REPO / "configs" / "nllb"


def hydra_train(nproc: int, config: str, *overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [tool("torchrun"), "--nproc_per_node", str(nproc), "--master_port",
               str(free_port()), tool("fairseq-hydra-train"), "--config-dir", str(CONFIGS),
               "--config-name", config, f"common.user_dir={PLUGIN_DIR}", *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_tiny_config_trains_on_two_cpu_ranks_with_overrides(corpus: Path, tmp_path: Path) -> None:
    completed = hydra_train(2, "tiny", f"task.data={corpus}", "optimization.max_update=15",
                            "common.log_format=json", "dataset.max_tokens=400",
                            "task.keep_root_gathered=true", cwd=tmp_path)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    assert "and the root over 2 ranks" in output
    losses = [float(entry["loss"]) for entry in parse_logs(output)["train_inner"]]
    assert len(losses) == 15 and losses[-1] < losses[0] - 1.0


@pytest.mark.parametrize("config", ["dense_600m", "dense_1_3b", "dense_3_3b"])
def test_dense_configs_compose(config: str, tmp_path: Path) -> None:
    completed = subprocess.run(
        [tool("fairseq-hydra-train"), "--config-dir", str(CONFIGS), "--config-name", config,
         "task.data=/data/nllb", f"common.user_dir={PLUGIN_DIR}", "--cfg", "job"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert f"_name: nllb_{config}" in completed.stdout
    assert "ddp_backend: fully_sharded" in completed.stdout


def test_unknown_engine_from_a_hydra_override_is_refused(corpus: Path, tmp_path: Path) -> None:
    completed = hydra_train(1, "tiny", f"task.data={corpus}", "task.shard_engine=deepspeed",
                            cwd=tmp_path)
    assert completed.returncode != 0
    output = completed.stdout + completed.stderr
    # the task's dataclass config checks the choice when Hydra's config is merged into it
    assert "Invalid value 'deepspeed', expected one of [fsdp2, fairscale]" in output
