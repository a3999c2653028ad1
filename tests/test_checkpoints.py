"""Checkpoints on 2 gloo CPU ranks: crash safety (SIGKILL on every rank) and exact resume."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.harness import (
    PLUGIN_DIR,
    REPO,
    RunResult,
    free_port,
    parse_logs,
    run_training,
    tool,
    training_args,
    transformer_args,
)

TINY = transformer_args(dim=64, ffn=128, layers=2)
UPDATES = 40
# 128 tokens per rank: an epoch is longer than 40 updates, so every resume below lands in
# epoch 1. fairseq itself resumes exactly only there: an epoch reached by training on
# regroups the same batches of epoch 1, while an epoch built on resume makes new batches
# (README "Checkpoints"), so a resume in epoch 2+ trains on other batches than a run that
# was never stopped.
MAX_TOKENS = 128
CRASH_HELPER = REPO / "tests" / "helpers" / "crash_training.py"


def args(corpus: Path, save_dir: Path, *extra: str) -> list[str]:
    return training_args(corpus, save_dir, UPDATES, max_tokens=MAX_TOKENS) + TINY + [
        "--save-interval-updates", "10", *extra]


def crash_training(mode: str, update: int, fairseq_args: list[str]) -> RunResult:
    """Train on 2 ranks under ``crash_training.py``, which SIGKILLs every rank at a save."""
    command = [tool("torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(CRASH_HELPER), mode, str(update),
               *fairseq_args, "--user-dir", str(PLUGIN_DIR), "--ddp-backend", "fully_sharded"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300,
                               cwd=REPO)
    output = completed.stdout + completed.stderr
    return RunResult(completed.returncode, output, parse_logs(output))


def saved_update(checkpoint: Path) -> int:
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    return state["optimizer_history"][-1]["num_updates"]


@pytest.fixture(scope="module")
def uninterrupted(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[RunResult, Path]:
    save_dir = tmp_path_factory.mktemp("uninterrupted")
    return run_training(args(corpus, save_dir), nproc=2, plugin=True), save_dir


@pytest.fixture(scope="module")
def crashes(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Killed after the update-20 save, resumed and killed in the update-30 save, resumed."""
    save_dir = tmp_path_factory.mktemp("crashed")
    after_save = crash_training("after-save", 20, args(corpus, save_dir))
    last_after_first_crash = saved_update(save_dir / "checkpoint_last.pt")
    during_copy = crash_training("during-copy", 30, args(corpus, save_dir))
    leftovers = sorted(p.name for p in save_dir.glob(".checkpoint_last.pt.partial-*"))
    last_after_second_crash = saved_update(save_dir / "checkpoint_last.pt")
    resumed = run_training(args(corpus, save_dir), nproc=2, plugin=True)
    return {"after_save": after_save, "during_copy": during_copy, "resumed": resumed,
            "last_after_first_crash": last_after_first_crash,
            "last_after_second_crash": last_after_second_crash,
            "leftovers": leftovers, "save_dir": save_dir}


def test_sigkill_after_a_save_keeps_that_checkpoint(crashes: dict) -> None:
    run = crashes["after_save"]
    assert run.returncode != 0
    assert run.series("train_inner", "num_updates")[-1] == 20  # killed before update 21
    assert crashes["last_after_first_crash"] == 20


def test_sigkill_during_the_copy_to_checkpoint_last_keeps_the_previous_one(
    crashes: dict,
) -> None:
    run = crashes["during_copy"]
    assert run.returncode != 0
    assert "Loaded checkpoint" in run.output
    assert run.series("train_inner", "num_updates") == [float(n) for n in range(21, 31)]
    # The crash really hit the copy: its half-written temporary file is still there ...
    assert crashes["leftovers"], "the copy to checkpoint_last.pt was not interrupted"
    # ... while checkpoint_last.pt is still the complete update-20 checkpoint.
    assert crashes["last_after_second_crash"] == 20
    assert saved_update(next(crashes["save_dir"].glob("checkpoint_*_30.pt"))) == 30


def test_resume_after_crashes_reproduces_the_uninterrupted_losses(
    crashes: dict, uninterrupted: tuple[RunResult, Path]
) -> None:
    reference = uninterrupted[0].series("train_inner", "loss")
    assert len(reference) == UPDATES
    resumed = crashes["resumed"]
    assert resumed.series("train_inner", "num_updates")[0] == 21
    assert resumed.series("train_inner", "loss") == reference[20:]
    assert crashes["during_copy"].series("train_inner", "loss") == reference[20:30]
    # the next save cleaned up the temporary file of the interrupted one
    assert not list(crashes["save_dir"].glob(".*.partial-*"))
