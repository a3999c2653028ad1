"""Unworkable configurations stop with one clear line before anything is written."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from benchmarks.harness import PLUGIN_DIR, tool, training_args, transformer_args

TINY = transformer_args(dim=32, ffn=64, layers=1)


def fairseq_train(corpus: Path, save_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [tool("fairseq-train"), *training_args(corpus, save_dir, 2), *TINY,
               "--user-dir", str(PLUGIN_DIR), "--ddp-backend", "fully_sharded", *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--amp"], "--amp"),
        (["--store-ema"], "--store-ema"),
        (["--zero-sharding", "os"], "--zero-sharding"),
        (["--use-sharded-state"], "--use-sharded-state"),
        (["--distributed-world-size", "2"], "torchrun --nproc_per_node 2"),
    ],
)
def test_refused_before_training_with_the_flag_named(
    corpus: Path, tmp_path: Path, flags: list[str], names: str
) -> None:
    save_dir = tmp_path / "save"
    completed = fairseq_train(corpus, save_dir, *flags)
    assert completed.returncode != 0
    last_line = completed.stderr.strip().splitlines()[-1]
    assert last_line.startswith("fairseq-shard-plugin: error: ") and names in last_line
    assert not save_dir.exists()


def test_unknown_engine_is_refused_by_the_flag_parser(corpus: Path, tmp_path: Path) -> None:
    completed = fairseq_train(corpus, tmp_path / "save", "--task", "sharded_translation",
                              "--shard-engine", "deepspeed")
    assert completed.returncode != 0
    assert "--shard-engine: invalid choice: 'deepspeed'" in completed.stderr


def test_single_process_without_torchrun_trains_on_a_one_rank_group(
    corpus: Path, tmp_path: Path
) -> None:
    completed = fairseq_train(corpus, tmp_path / "save", "--no-save")
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "and the root over 1 ranks" in completed.stdout + completed.stderr
