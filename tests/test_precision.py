"""fp16/bf16 with fp32 master shards on 2 CPU ranks: accuracy, overflow handling, masters.

Tolerance: 16-bit compute changes each update's logged loss by at most 0.1% (fp16) and
0.5% (bf16) relative to an unsharded fp32 reference over 50 updates; measured here at about
0.01% and 0.04% (the log itself rounds losses to 3 decimals).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.harness import (
    PLUGIN_DIR,
    REPO,
    RunResult,
    free_port,
    in_threads,
    result_of,
    run_training,
    tool,
    training_args,
)

from tiny_training import REFERENCE_UPDATES, TINY

UPDATES = REFERENCE_UPDATES
TOLERANCE = {"fp16": 1e-3, "bf16": 5e-3}
HELPERS = REPO / "tests" / "helpers"


@pytest.fixture(scope="module")
def runs(
    corpus: Path, tmp_path_factory: pytest.TempPathFactory, stock_tiny_run: RunResult,
    sharded_tiny_run: tuple[RunResult, Path],
) -> dict[str, RunResult]:
    """The unsharded stock fp32 reference, the sharded fp32 run (both shared with other
    modules) and the sharded fp16 and bf16 runs of the same training."""
    results = {"reference": stock_tiny_run, "fp32": sharded_tiny_run[0]}

    def job(name: str) -> Callable[[], RunResult]:
        save_dir = tmp_path_factory.mktemp(name)
        args = training_args(corpus, save_dir, UPDATES) + TINY + [
            "--task", "sharded_translation", f"--{name}"]

        def train() -> RunResult:
            run = run_training(args, nproc=2, plugin=True)
            run.save_dir = save_dir  # type: ignore[attr-defined]
            return run

        return train

    sixteen_bit = in_threads({name: job(name) for name in ("fp16", "bf16")})  # memory is
    # per process: the peaks compared below do not depend on running both at once
    return {**results, **{name: result_of(sixteen_bit, name) for name in sixteen_bit}}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_16_bit_tracks_the_fp32_reference(runs: dict[str, RunResult], precision: str) -> None:
    reference = runs["reference"].series("train_inner", "loss")
    losses = runs[precision].series("train_inner", "loss")
    assert len(losses) == len(reference) == UPDATES
    worst = max(abs(a - b) / b for a, b in zip(losses, reference, strict=True))
    assert worst <= TOLERANCE[precision]
    assert losses[-1] < losses[0] - 1.0


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_16_bit_compute_lowers_the_peak(runs: dict[str, RunResult], precision: str) -> None:
    fp32_peak = runs["fp32"].series("train", "train_peak_mem_gb")[-1]
    assert runs[precision].series("train", "train_peak_mem_gb")[-1] < 0.9 * fp32_peak
    # the model state (fp32 masters, gradients, Adam moments) is the same in every precision
    fp32_state = runs["fp32"].series("train", "train_state_mem_gb")[-1]
    assert runs[precision].series("train", "train_state_mem_gb")[-1] == fp32_state


def test_fp16_logs_its_loss_scale(runs: dict[str, RunResult]) -> None:
    assert float(runs["fp16"].logs["train_inner"][-1]["loss_scale"]) > 0
    assert "loss_scale" not in runs["bf16"].logs["train_inner"][-1]


def torchrun(script: str, *args: str, env: dict[str, str] | None = None) -> None:
    command = [tool("torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
               str(HELPERS / script), *args]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300,
                               env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    assert completed.returncode == 0, completed.stderr[-4000:]


def test_overflow_on_one_rank_skips_the_step_on_all(corpus: Path, tmp_path: Path) -> None:
    report_path = tmp_path / "overflow.json"
    args = training_args(corpus, tmp_path, 8) + TINY + [
        "--fp16", "--no-save", "--user-dir", str(PLUGIN_DIR), "--ddp-backend", "fully_sharded"]
    torchrun("train_with_overflow.py", *args,
             env={"INJECT_UPDATE": "3", "REPORT": str(report_path)})
    report = json.loads(report_path.read_text())
    assert report["params_identical"] and report["optimizer_identical"]
    assert report["scale_after"] == report["scale_before"] / 2
    assert report["updates_after"] == report["updates_before"] == 3
    assert not report["logged"]  # as in fairseq: train_step returns None, nothing is logged


def test_fp16_checkpoint_holds_fp32_masters_that_reload_exactly(
    runs: dict[str, RunResult], corpus: Path, tmp_path: Path
) -> None:
    checkpoint = runs["fp16"].save_dir / "checkpoint_last.pt"  # type: ignore[attr-defined]
    report_path = tmp_path / "reload.json"
    torchrun("reload_masters.py", str(checkpoint), str(report_path), str(corpus), *TINY,
             "--fp16", "--cpu", "--task", "translation", "--optimizer", "adam", "--lr", "1e-3",
             "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
             "--ddp-backend", "fully_sharded")
    report = json.loads(report_path.read_text())
    assert report["saved_dtypes"] == report["master_dtypes"] == ["torch.float32"]
    assert report["masters_equal"] and report["optimizer_equal"]
    assert report["loss_scale"] == report["saved_loss_scale"] > 0


def test_minimum_loss_scale_stops_every_rank_with_that_error(corpus: Path, tmp_path: Path) -> None:
    """fairseq saves crash.pt from its exception handler and reruns the step under its
    NanDetector: the save alone on a rank (a collective) must not hang or mask the error,
    and the rerun's torch-2 StopIteration must not replace it."""
    args = training_args(corpus, tmp_path, 3) + TINY + [
        "--task", "sharded_translation", "--fp16", "--fp16-init-scale", str(2**40),
        "--min-loss-scale", "1e12"]
    run = run_training(args, nproc=2, plugin=True, check=False)
    assert run.returncode != 0
    for rank in range(2):
        assert f"[rank{rank}]: FloatingPointError: Minimum loss scale reached" in run.output
    assert "StopIteration" not in run.output and "gloo" not in run.output.split(
        "Minimum loss scale reached")[-1]
    assert not (tmp_path / "crash.pt").exists()
