"""The plugin's host work per update stays close to stock fairseq's (a CPU proxy for GPU
speed, where each aten operation is a kernel launch and host time): the aten operations
one update dispatches, counted in fresh processes at world size 1 by
``benchmarks/dispatch_ops.py`` (issue 28: the plugin dispatched 1.24x stock's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import gpu_check, gpu_offload
from benchmarks.dispatch_ops import compare, largest_differences
from launching.harness import training_args

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)

LIMIT = 1.3  # the goal is 1.1x for fp32 (benchmarks/results/dispatch_ops.md)


def test_operations_per_update_stay_within_1_3x_of_stock(corpus: Path, tmp_path: Path) -> None:
    one_unit = "plugin fsdp2, one unit kept gathered"  # the GPU check's world-size-1 lever
    rows = compare(corpus, tmp_path, updates=7, time_them=False,
                   names=("stock legacy_ddp", "plugin fsdp2", one_unit))  # bf16: benchmark's
    for name, row in rows.items():
        assert row["ops_per_update"] > 1000, (name, row["ops_per_update"])
        assert row["vs_stock"] <= LIMIT, (name, row["vs_stock"],
                                          largest_differences(rows, name, top=6))
    # one unit gathered from forward to backward dispatches what stock does (1.00x measured)
    assert rows[one_unit]["vs_stock"] <= 1.05, largest_differences(rows, one_unit, top=6)
    # the gradient norm takes a few foreach operations, not three per parameter
    ours, stock = rows["plugin fsdp2"]["by_op"], rows["stock legacy_ddp"]["by_op"]
    assert ours.get("aten.pow.Tensor_Scalar", 0) < 10 < stock.get(
        "aten.linalg_vector_norm.default", 0)


def test_the_gpu_checks_steady_state_and_profile_come_from_a_real_run(
    corpus: Path, tmp_path: Path
) -> None:
    """fairseq-shard-measure-train records when each update's optimizer step began and
    profiles the updates asked for; the GPU check's steady-state figures come from them."""
    from benchmarks.gpu_check import model_flops_per_update, steady_state
    from launching.harness import run_training, training_args, transformer_args

    args = training_args(corpus, tmp_path / "save", max_update=8, max_tokens=256)
    # offloaded, as the 3.3B recipe's row (GPU check part 3) that reads the same records
    args += transformer_args(dim=32, ffn=64, layers=1, heads=2) + [
        "--no-save", "--disable-validation", "--task", "sharded_translation", "--cpu-offload"]
    run = run_training(args, nproc=1, plugin=True, measure_dir=tmp_path / "measured",
                       measure_options=("--profile-updates", "5-6"))
    record = run.memory[0]
    assert ("--cpu-offload on CPU ranks: the model state lives on the host already, so the "
            "offload only adds copies") in run.output  # (T1 #5, session 25)
    assert len(record["update_starts"]) == 8
    assert record["update_starts"] == sorted(record["update_starts"])
    assert record["profile"]["updates"] == 2
    assert record["profile"]["aten_calls_per_update"] > 100
    assert record["peak_bytes"] > 0  # a CPU run keeps the live-tensor meter
    steady = steady_state(run, (4, 7))
    words = sum(run.series("train_inner", "wpb")[3:7])
    seconds = record["update_starts"][6] - record["update_starts"][2]
    assert steady["steady_words_per_second"] == pytest.approx(words / seconds, rel=1e-3)
    # 6 FLOPs per weight and token dominate: 600M-shaped, 4096 tokens of 30-token sentences
    flops = model_flops_per_update(4096, 4096 / 30)
    assert 6 * 615e6 * 4096 * 0.9 < flops < 6 * 615e6 * 4096 * 1.3
    # each optimizer step's own time, inside the interval to the next update's step
    steps, starts = record["step_seconds"], record["update_starts"]
    assert len(steps) == 8 and all(step > 0 for step in steps)
    assert all(step < later - earlier
               for step, earlier, later in zip(steps, starts, starts[1:], strict=False))
    # the 3.3B recipe's row (GPU check part 3) reads them, and the waits for the host step
    from benchmarks.gpu_offload import measured_row

    row = measured_row(run, seconds=10.0, timeout=60.0, window=(3, 6))
    assert row["status"] == "ok" and row["host_peak_rss_gib"] > 0.1
    assert row["seconds_per_update"] == round((starts[5] - starts[1]) / 4, 2)
    assert row["step_seconds"] == round(sum(steps[2:6]) / 4, 2)
    assert row["host_wait_seconds"] == round(
        sum(run.series("train_inner", "host_wait")[2:6]) / 4, 2)
    assert 0 <= int(row["host_wait_share"].rstrip("%")) < 100


def test_a_second_gpu_check_call_measures_the_runs_a_first_one_left() -> None:
    from benchmarks.gpu_check import RUNS, selected_runs

    assert selected_runs(1) == ("gpu_check", RUNS)
    name, runs = selected_runs(5)
    assert name == "gpu_check_from5"
    assert runs == [RUNS[0], *RUNS[4:]] and not runs[0].plugin  # stock first, for the ratios


# every training the GPU check runs: part 1's rows and part 3's (the 3.3B one-GPU recipe)
GPU_TRAININGS = [(spec.name, gpu_check.MODEL, spec) for spec in gpu_check.RUNS] + [
    (f"3.3B recipe{' ' + ' '.join(flags) if flags else ''}", gpu_offload.MODEL,
     gpu_check.Run("3.3B", True, [*gpu_offload.RECIPE, *flags]))
    for flags in ([], ["--no-host-step-overlap"])]


@pytest.mark.parametrize(("model", "spec"), [(model, spec) for _, model, spec in GPU_TRAININGS],
                         ids=[name for name, _, _ in GPU_TRAININGS])
def test_every_gpu_check_training_is_a_command_fairseq_and_the_plugin_accept(
    corpus: Path, tmp_path: Path, model: list[str], spec: gpu_check.Run
) -> None:
    """Device time is scarce: a row whose flags fairseq or the plugin's checks refuse would
    spend it on an error. Each training command, as the GPU check builds it, parses and
    (the plugin's fsdp2 ones) passes the checks made before training."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_shard_plugin.tasks import register
    from fairseq_shard_plugin.training.validation import check_sharded_config

    register()  # the plugin's task and options, as --user-dir would
    backend = (["--ddp-backend", "fully_sharded"] if spec.plugin
               else ["--ddp-backend", spec.stock_backend])
    args = (training_args(corpus, tmp_path, max_update=40, max_tokens=spec.tokens, cpu=False)
            + model + spec.flags + ["--no-save", "--disable-validation"] + backend)
    cfg = convert_namespace_to_omegaconf(  # an unknown or misspelled flag fails here
        options.parse_args_and_arch(options.get_training_parser(), args))
    if spec.plugin and "fairscale" not in spec.flags:  # fairscale needs CUDA, not here
        cfg.common.cpu = True  # this machine's ranks; the row itself runs on CUDA
        check_sharded_config(cfg)
