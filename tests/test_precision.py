"""16-bit training on 2 CPU ranks: fp16/bf16 with fp32 master shards, and Meta's NLLB
model state (``--memory-efficient-fp16 --fp16-adam-stats``: 16-bit parameter, gradient and
moment shards, 8 bytes per parameter); accuracy, overflow handling, checkpoints.

Tolerance: 16-bit compute changes each update's logged loss by at most 0.1% (fp16, also
with 16-bit state) and 0.5% (bf16) relative to an unsharded fp32 reference over 50
updates; measured here at about 0.01%, 0.04% and 0.03% (16-bit state; the log itself
rounds losses to 3 decimals).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from launching.harness import (
    PLUGIN_DIR,
    REPO,
    RunResult,
    in_threads,
    result_of,
    run_helper,
    run_training,
    training_args,
    transformer_args,
)

from tiny_training import REFERENCE_UPDATES, SHARDED, TINY

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)

UPDATES = REFERENCE_UPDATES
TOLERANCE = {"fp16": 1e-3, "bf16": 5e-3, "fp16 moments": 1e-3, "16-bit state": 1e-3}
# the run's flags; "16-bit state" also saves at update 25, for the resume below
FLAGS = {"fp16": ["--fp16"], "bf16": ["--bf16"],
         # fp32 masters and gradients, fp16 moments: the loss scale reaches the plugin's
         # Adam as a factor on fp32 gradients
         "fp16 moments": ["--fp16", "--fp16-adam-stats"],
         "16-bit state": ["--memory-efficient-fp16", "--fp16-adam-stats",
                          "--save-interval-updates", "25"]}
HELPERS = REPO / "tests" / "helpers"


@pytest.fixture(scope="module")
def runs(
    corpus: Path, tmp_path_factory: pytest.TempPathFactory, stock_tiny_run: RunResult,
    sharded_tiny_run: tuple[RunResult, Path],
) -> dict[str, RunResult]:
    """The unsharded stock fp32 reference, the sharded fp32 run (both shared with other
    modules) and the sharded 16-bit runs of the same training (:data:`FLAGS`)."""
    results = {"reference": stock_tiny_run, "fp32": sharded_tiny_run[0]}

    def job(name: str) -> Callable[[], RunResult]:
        save_dir = tmp_path_factory.mktemp(name.replace(" ", "_"))
        args = training_args(corpus, save_dir, UPDATES) + TINY + [
            "--task", "sharded_translation", *FLAGS[name]]

        def train() -> RunResult:
            run = run_training(args, nproc=2, plugin=True)
            run.save_dir = save_dir  # type: ignore[attr-defined]
            return run

        return train

    sixteen_bit = in_threads({name: job(name) for name in FLAGS})  # memory is
    # per process: the peaks compared below do not depend on running both at once
    return {**results, **{name: result_of(sixteen_bit, name) for name in sixteen_bit}}


@pytest.mark.parametrize("precision", list(FLAGS))
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


def test_fp16_moments_take_a_quarter_less_model_state(runs: dict[str, RunResult]) -> None:
    """12 bytes per parameter (fp32 masters and gradients, fp16 moments) against 16."""
    fp32_state = runs["fp32"].series("train", "train_state_mem_gb")[-1]
    state = runs["fp16 moments"].series("train", "train_state_mem_gb")[-1]
    assert state == pytest.approx(0.75 * fp32_state, abs=1e-4)  # logged to 1e-4 GB


def test_fp16_logs_its_loss_scale(runs: dict[str, RunResult]) -> None:
    assert float(runs["fp16"].logs["train_inner"][-1]["loss_scale"]) > 0
    assert "loss_scale" not in runs["bf16"].logs["train_inner"][-1]


def test_fp16_on_cpu_ranks_says_it_is_slow_there(runs: dict[str, RunResult]) -> None:
    """A GPU config on a CPU machine ran ten times slower, unsaid (T1 #5, session 25): fp16
    matrix products took 35 times fp32's here."""
    hint = "fp16 compute on CPU ranks: most CPUs run fp16 far slower than fp32 or bf16"
    assert runs["fp16"].output.count(hint) == 1 and hint not in runs["bf16"].output  # once




def test_overflow_on_one_rank_skips_the_step_on_all(corpus: Path, tmp_path: Path) -> None:
    report_path = tmp_path / "overflow.json"
    args = training_args(corpus, tmp_path, 8) + TINY + [
        "--fp16", "--no-save", "--user-dir", str(PLUGIN_DIR), "--ddp-backend", "fully_sharded"]
    run_helper(HELPERS / "train_with_overflow.py", *args,
               environment={"INJECT_UPDATE": "3", "REPORT": str(report_path)})
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
    run_helper(HELPERS / "reload_masters.py", str(checkpoint), str(report_path), str(corpus),
               *TINY, "--fp16", "--cpu", "--task", "translation", "--optimizer", "adam",
               "--lr", "1e-3", "--criterion", "label_smoothed_cross_entropy",
               "--label-smoothing", "0.1", "--ddp-backend", "fully_sharded")
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
    assert run.returncode == 1
    # every rank, one line with what to do (it was a traceback a rank, T1 #3)
    errors = [line for line in run.output.splitlines()
              if line.startswith("fairseq-shard-plugin: error: ")]
    assert errors == 2 * ["fairseq-shard-plugin: error: update 1: fp16's loss scale fell from "
                          "--fp16-init-scale 1.09951e+12 to --min-loss-scale 1e+12, every "
                          "scale overflowing (diverged, or the two are close together); no "
                          "checkpoint was saved yet: start again with a lower --lr or a "
                          "--clip-norm, or train with --bf16, whose range needs no loss "
                          "scale"], run.output[-3000:]
    assert "Traceback" not in run.output and "StopIteration" not in run.output
    assert not (tmp_path / "crash.pt").exists()


def test_16_bit_state_resumes_exactly_from_an_interval_checkpoint(
    runs: dict[str, RunResult], corpus: Path, tmp_path: Path
) -> None:
    """16-bit parameters, fp16 moments and their scales are all in the checkpoint: the
    second half of the run, resumed from update 25, repeats the uninterrupted one."""
    uninterrupted = runs["16-bit state"]
    (restore,) = uninterrupted.save_dir.glob("checkpoint_*_25.pt")  # type: ignore[attr-defined]
    args = training_args(corpus, tmp_path, UPDATES) + TINY + [
        "--task", "sharded_translation", *FLAGS["16-bit state"], "--restore-file", str(restore)]
    resumed = run_training(args, nproc=2, plugin=True)
    for key in ("loss", "gnorm"):
        continued = resumed.series("train_inner", key)
        assert len(continued) == UPDATES - 25
        assert continued == uninterrupted.series("train_inner", key)[25:]


def test_16_bit_state_is_8_bytes_per_parameter_and_reloads_on_three_ranks(
    runs: dict[str, RunResult], corpus: Path, tmp_path: Path
) -> None:
    """The 2-rank checkpoint loads into 3 ranks' shards unchanged (a full checkpoint holds
    each moment's one scale, the same on every rank), and the shards hold 16-bit
    parameters and moments: 6 bytes per parameter between steps, 8 with the gradients.
    (The file holds them as fp32, as fairseq writes every 16-bit tensor.)"""
    checkpoint = runs["16-bit state"].save_dir / "checkpoint_last.pt"  # type: ignore[attr-defined]
    report_path = tmp_path / "reload.json"
    run_helper(HELPERS / "reload_masters.py", str(checkpoint), str(report_path), str(corpus),
               *TINY, "--cpu", "--task", "translation", "--optimizer", "adam", "--lr", "1e-3",
               "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
               "--ddp-backend", "fully_sharded", "--memory-efficient-fp16", "--fp16-adam-stats",
               nproc=3)
    report = json.loads(report_path.read_text())
    assert report["master_dtypes"] == ["torch.float16"]
    assert report["moment_dtypes"] == ["torch.float16"]
    assert report["masters_equal"] and report["optimizer_equal"]
    assert report["state_bytes_per_parameter"] == pytest.approx(6.0, abs=0.01)
    # the tied embedding and output projection, widened to fp32, are stored once
    saved = torch.load(checkpoint, weights_only=True)["model"]
    tied = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
            "decoder.output_projection.weight")
    assert len({saved[name].untyped_storage().data_ptr() for name in tied}) == 1


# A model whose checkpoint is mostly what its tensors' bytes leave out (the pickled config
# and meters, a zip record per tensor): the log announced 25% less than was written.
SMALL = transformer_args(dim=16, ffn=32, layers=1)
SMALL_FLAGS = {"small fp32": [], "small memory-efficient bf16": ["--memory-efficient-bf16"],
               "small sharded fp16": ["--fp16", *SHARDED],
               "small sharded 16-bit shards": ["--memory-efficient-bf16", *SHARDED]}


@pytest.fixture(scope="module")
def small_runs(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The save dirs of 2-update trainings of :data:`SMALL` (:data:`SMALL_FLAGS`)."""
    def job(name: str) -> Callable[[], Path]:
        save_dir = tmp_path_factory.mktemp(name.replace(" ", "_"))
        args = training_args(corpus, save_dir, 2) + SMALL + [
            "--task", "sharded_translation", *SMALL_FLAGS[name]]

        def train() -> Path:
            run = run_training(args, nproc=2, plugin=True)
            (save_dir / "train.log").write_text(run.output)
            return save_dir

        return train

    trained = in_threads({name: job(name) for name in SMALL_FLAGS})
    return {name: result_of(trained, name) for name in trained}


def _written_bytes(save_dir: Path) -> int:
    """checkpoint_last.pt's size, with the shard directory its index refers to."""
    index = save_dir / "checkpoint_last.pt"
    shards = torch.load(index, weights_only=True).get("sharded_checkpoint")
    files = [index, *((save_dir / shards["dir"]).rglob("*") if shards else ())]
    return sum(file.stat().st_size for file in files if file.is_file())


@pytest.mark.parametrize("precision", ["fp32", *FLAGS, *SMALL_FLAGS])
def test_the_checkpoint_size_in_the_log_is_what_is_written(
    precision: str, request: pytest.FixtureRequest
) -> None:
    """The log's size of a checkpoint, in every precision mode: a full checkpoint stores
    16-bit tensors as fp32 (it once announced half of what was written), and a small
    model's is mostly the config and a record per tensor, besides the tensors' bytes."""
    if precision in SMALL_FLAGS:
        save_dir = request.getfixturevalue("small_runs")[precision]
        output = (save_dir / "train.log").read_text()
    else:  # the module's runs
        run = request.getfixturevalue("runs")[precision]
        save_dir = (request.getfixturevalue("sharded_tiny_run")[1] if precision == "fp32"
                    else run.save_dir)
        output = run.output
    lines = [line for line in output.splitlines() if "checkpoints of this run: about " in line]
    assert len(lines) == 1, lines
    value, unit = re.search(r"about ([0-9.]+) (KiB|MiB|GiB) each", lines[0]).groups()
    announced = float(value) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    written = _written_bytes(save_dir)
    assert abs(announced - written) / written < 0.10, (announced, written)


def test_an_export_of_16_bit_shards_is_fp32_as_from_a_full_checkpoint(
    small_runs: dict[str, Path], tmp_path: Path
) -> None:
    """The same --memory-efficient-bf16 run exported bf16 from its sharded checkpoints and
    fp32 from full ones; now fp32 either way (values unchanged), bf16 when asked."""
    from fairseq_shard_plugin.checkpoint.consolidate import export_consolidated, read_full_state

    source = small_runs["small sharded 16-bit shards"] / "checkpoint_last.pt"
    shards = read_full_state(source)["model"]
    assert {t.dtype for t in shards.values() if t.is_floating_point()} == {torch.bfloat16}
    export_consolidated(source, tmp_path / "plain.pt")
    export_consolidated(source, tmp_path / "bf16.pt", torch.bfloat16)
    plain, sixteen = (torch.load(tmp_path / name, weights_only=True)["model"]
                      for name in ("plain.pt", "bf16.pt"))
    for name, tensor in shards.items():
        if tensor.is_floating_point():
            assert plain[name].dtype == torch.float32 and sixteen[name].dtype == torch.bfloat16
            assert torch.equal(plain[name], tensor.float()) and torch.equal(sixteen[name], tensor)
    full = small_runs["small memory-efficient bf16"] / "checkpoint_last.pt"
    assert {t.dtype for t in torch.load(full, weights_only=True)["model"].values()
            if t.is_floating_point()} == {torch.float32}


def test_an_fp16_resume_keeps_the_loss_scalers_schedule(corpus: Path, tmp_path: Path) -> None:
    """fairseq saves the loss scale only: the counters that decide when it next doubles
    (a window of updates without overflow) restarted at the resume, so the scale, and
    from the first overflow on the updates themselves, differed from the run never stopped."""
    def train(save_dir: Path, *extra: str) -> RunResult:
        args = training_args(corpus, save_dir, 8) + TINY + [
            "--task", "sharded_translation", "--fp16", "--fp16-scale-window", "3",
            "--save-interval-updates", "4", *extra]
        return run_training(args, nproc=2, plugin=True)

    uninterrupted = train(tmp_path / "whole")
    (restore,) = (tmp_path / "whole").glob("checkpoint_*_4.pt")
    resumed = train(tmp_path / "resumed", "--restore-file", str(restore))
    for key in ("loss_scale", "loss", "gnorm"):
        assert resumed.series("train_inner", key) == uninterrupted.series("train_inner",
                                                                           key)[4:], key
