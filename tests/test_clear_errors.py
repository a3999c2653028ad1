"""Unworkable configurations stop with one clear line before anything is written.

Each case is a real single-process ``fairseq-train``; the module starts them all at once
(the time of a refusal is process start-up, which two cores can overlap).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from benchmarks.harness import (
    PLUGIN_DIR,
    run_concurrently,
    tool,
    training_args,
    transformer_args,
)

TINY = transformer_args(dim=32, ffn=64, layers=1)
REFUSED = {
    "--amp": ["--amp"],
    "--store-ema": ["--store-ema"],
    "--zero-sharding": ["--zero-sharding", "os"],
    "--use-sharded-state": ["--use-sharded-state"],
    "torchrun --nproc_per_node 2": ["--distributed-world-size", "2"],
    "--base-layers": ["--base-layers", "1"],
    "--save-on-signal: SIGFOO is not a signal": [
        "--task", "sharded_translation", "--save-on-signal", "usr1,foo"],
}
UNKNOWN_ENGINE = ["--task", "sharded_translation", "--shard-engine", "deepspeed"]
ONE_RANK = ["--no-save"]


@pytest.fixture(scope="module")
def launches(
    corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every case's finished ``fairseq-train`` and its --save-dir, all run concurrently."""
    cases = dict(REFUSED, unknown_engine=UNKNOWN_ENGINE, one_rank=ONE_RANK, fairscale_shards=[])
    save_dirs = {name: tmp_path_factory.mktemp("refused") / "save" for name in cases}
    save_dirs["fairscale_shards"].mkdir()
    (save_dirs["fairscale_shards"] / "checkpoint_last-shard0.pt").write_bytes(b"stock run")
    finished = run_concurrently({
        name: [tool("fairseq-train"), *training_args(corpus, save_dirs[name], 2), *TINY,
               "--user-dir", str(PLUGIN_DIR), "--ddp-backend", "fully_sharded", *extra]
        for name, extra in cases.items()})
    return {name: (finished[name], save_dirs[name]) for name in cases}


@pytest.mark.parametrize("names", list(REFUSED))
def test_refused_before_training_with_the_flag_named(
    launches: dict[str, tuple[subprocess.CompletedProcess, Path]], names: str
) -> None:
    completed, save_dir = launches[names]
    assert completed.returncode != 0
    last_line = completed.stderr.strip().splitlines()[-1]
    assert last_line.startswith("fairseq-shard-plugin: error: ") and names in last_line
    assert not save_dir.exists()


def test_unknown_engine_is_refused_by_the_flag_parser(
    launches: dict[str, tuple[subprocess.CompletedProcess, Path]],
) -> None:
    completed, _ = launches["unknown_engine"]
    assert completed.returncode != 0
    assert "--shard-engine: invalid choice: 'deepspeed'" in completed.stderr


def test_single_process_without_torchrun_trains_on_a_one_rank_group(
    launches: dict[str, tuple[subprocess.CompletedProcess, Path]],
) -> None:
    completed, _ = launches["one_rank"]
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "and the root over 1 ranks" in completed.stdout + completed.stderr


def test_checkpoints_of_fairseqs_own_fully_sharded_are_not_silently_skipped(
    launches: dict[str, tuple[subprocess.CompletedProcess, Path]],
) -> None:
    """fairseq's fairscale path saves checkpoint_last-shard0.pt, ...; without the plugin
    telling, a switched run would find no checkpoint_last.pt and start from scratch."""
    completed, save_dir = launches["fairscale_shards"]
    assert completed.returncode != 0
    last_line = completed.stderr.strip().splitlines()[-1]
    assert last_line.startswith("fairseq-shard-plugin: error: ")
    assert "--restore-file" in last_line and "checkpoint_last-shard0.pt" in last_line
    assert [f.name for f in save_dir.iterdir()] == ["checkpoint_last-shard0.pt"]
