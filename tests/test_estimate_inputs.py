"""fairseq-shard-estimate on what users give it: micro-batches, layer-bound shapes, training
commands whose flags it cannot honour, CPU ranks with offload, and measure-train's inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import estimate_layers
from fairseq_shard_plugin.cli.estimate import main as estimate_main
from fairseq_shard_plugin.memory.estimate import EstimateError, run
from launching.harness import PLUGIN_DIR, RESULTS

TINY = ["--arch", "transformer", "--encoder-layers", "2", "--decoder-layers", "2",
        "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
        "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
        "--share-all-embeddings"]


def requested(flags: list[str]) -> dict:
    return run(flags)["configurations"]["requested"]


def test_gradient_shards_of_earlier_micro_batches_are_counted_in_every_phase() -> None:
    """With --update-freq above 1 each micro-batch reduce-scatters into the gradient shards,
    so from the second on all of them are live through the loss and the layers' backward
    (measured by hand on 2 CPU ranks, d 256: 0.0565 GiB logged for 12 single batches,
    0.0617 for the same batches two or four per update)."""
    flags = ["--arch", "nllb_dense_600m", "--world-size", "2", "--memory-efficient-fp16",
             "--fp16-adam-stats", "--criterion", "chunked_label_smoothed_cross_entropy",
             "--checkpoint-activations"]
    one, two = requested(flags), requested([*flags, "--update-freq", "2"])
    assert one["peak_phase"] == two["peak_phase"] == "loss backward"
    assert one["grads_gib"] == 0 and two["grads_gib"] == pytest.approx(two["step_grads_gib"])
    assert two["peak_gib"] == pytest.approx(one["peak_gib"] + two["step_grads_gib"])
    assert requested([*flags, "--update-freq", "4"])["peak_gib"] == two["peak_gib"]
    # offloaded gradient shards accumulate on the host: the device peak is unchanged
    offloaded = [*flags, "--cpu-offload"]
    assert requested([*offloaded, "--update-freq", "2"])["peak_gib"] == pytest.approx(
        requested(offloaded)["peak_gib"])


def test_a_training_commands_update_freq_reaches_the_estimate(corpus: Path,
                                                              capsys: pytest.CaptureFixture
                                                              ) -> None:
    command = [str(corpus), *TINY, "--task", "sharded_translation", "--user-dir",
               str(PLUGIN_DIR), "--ddp-backend", "fully_sharded", "--optimizer", "adam",
               "--max-tokens", "512", "--update-freq", "1,3"]
    estimate_main(["--world-size", "2", "--json", "--", *command])
    report = json.loads(capsys.readouterr().out)
    assert report["setup"]["update_freq"] == 3  # fairseq's per-epoch list: its largest
    assert "--update-freq" in report["flags"] and report["notes"] == []


def test_the_estimate_holds_where_a_layers_backward_decides_the_peak() -> None:
    """Against the committed measurements of layer-bound shapes (small vocabulary, 2,048 to
    4,096 tokens; ``python -m benchmarks.estimate_layers``): the layer's own working set
    was missing, 5-20% low (d 512, fp32, activation checkpointing: 370 MiB estimated, 462
    measured)."""
    rows = json.loads((RESULTS / "estimate_layers.json").read_text())
    assert len(rows) >= 10
    flags = {name: flags for *_, (name, flags) in estimate_layers.SHAPES}
    for row in rows:
        estimated, _ = estimate_layers.estimated(
            estimate_layers.model_flags(row["d"], row["ffn"], row["layers"]),
            flags[row["configuration"]], row["tokens"], row["precision"], row["ranks"])
        assert estimated == pytest.approx(row["estimated_mib"], abs=0.1), row  # file current
        assert abs(estimated - row["measured_mib"]) / row["measured_mib"] < 0.03, row


def test_on_cpu_ranks_offloading_leaves_the_state_in_the_peak() -> None:
    """On CPU ranks the host is the device: --cpu-offload moves nothing, so the peak and
    the --memory-budget fit count the model state (a budget of 40 GiB once proposed 116,480
    tokens whose training step needed 65 GiB), and offload is not what helps most."""
    flags = ["--arch", "nllb_dense_3_3b", "--world-size", "2", "--cpu", "--checkpoint-activations",
             "--criterion", "chunked_label_smoothed_cross_entropy"]
    plain, offloaded = run(flags), run([*flags, "--cpu-offload"])
    assert offloaded["configurations"]["requested"]["peak_gib"] == pytest.approx(
        plain["configurations"]["requested"]["peak_gib"])
    assert offloaded["configurations"]["requested"]["host_gib"] == 0
    assert (plain["helps_most"] or {}).get("flag") != "--cpu-offload"
    report = run([*flags, "--cpu-offload", "--memory-budget", "40"])
    tokens = report["fits"]["max_tokens"]["requested"]
    at_fit = run([*flags, "--cpu-offload", "--max-tokens", str(tokens)])
    assert at_fit["host"]["cases"]["training step"]["per_rank_gib"] <= 40
    # on GPUs the state leaves the device
    gpu = run([flag for flag in flags if flag != "--cpu"] + ["--cpu-offload"])
    assert gpu["configurations"]["requested"]["host_gib"] > 0


def test_a_sentence_is_never_longer_than_its_batch() -> None:
    """--tokens-per-sentence 100000 with 4,096 tokens gave 2,405 GiB of attention: one
    sentence fills the batch at most."""
    long = requested(["--tokens-per-sentence", "100000"])["peak_gib"]
    assert long == pytest.approx(requested(["--tokens-per-sentence", "4096"])["peak_gib"])


@pytest.mark.parametrize(("flags", "line"), [
    (["--memory-budget", "inf"], "--memory-budget must be a size above 0 GiB, got inf"),
    (["--attention-dropout", "-1"],
     "--attention-dropout must be a probability in [0, 1), got -1.0"),
    (["--update-freq", "0"], "--update-freq must be at least 1, got 0"),
])
def test_values_the_estimate_cannot_mean_are_refused(flags: list[str], line: str) -> None:
    with pytest.raises(EstimateError) as refused:
        run(flags)
    assert str(refused.value) == line


def refusal(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as refused:
        estimate_main(argv)
    return str(refused.value.code)


def test_a_training_commands_flaws_are_one_line_naming_the_cause(corpus: Path) -> None:
    command = [str(corpus), *TINY, "--task", "sharded_translation", "--user-dir",
               str(PLUGIN_DIR), "--ddp-backend", "fully_sharded", "--optimizer", "adam",
               "--max-tokens", "512"]
    prefix = "fairseq-shard-estimate: error: the training command after --: "
    # model options before -- were printed as used while the command's model was estimated
    for flag in (["--vocab", "100000"], ["--encoder-layers=12"], ["--arch", "nllb_dense_600m"],
                 ["--no-share-all-embeddings"], ["--voc", "100"], ["--encoder-lay", "6"]):
        assert refusal([*flag, "--", *command]) == (
            f"fairseq-shard-estimate: error: {flag[0].split('=')[0]} before --: the model "
            "estimated is the one the training command builds; change it in the command "
            "after --")
    for mixed in (["--fp16", "--bf16"], ["--fp16", "--memory-efficient-bf16"],
                  ["--memory-efficient-fp16", "--bf16"]):  # fairseq names a TPU
        assert refusal(["--", *command, *mixed]) == (
            prefix + "give fp16 flags (--fp16, --memory-efficient-fp16) or bf16 ones, not both")
    missing = corpus.parent / "no-such-user-dir"
    assert refusal(["--", *command, "--user-dir", str(missing)]) == (
        prefix + f"FileNotFoundError: {missing}")
    assert refusal(["--", *command, "--max-tokens", "0"]) == (
        "fairseq-shard-estimate: error: --max-tokens 0: give the tokens per batch, at least 1")


def test_what_the_command_does_not_say_is_named(corpus: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    command = [str(corpus), *TINY, "--optimizer", "adam", "--max-tokens", "512"]
    estimate_main(["--", *command])
    out = capsys.readouterr().out
    assert ("Assumed, as the command does not say: --world-size 2 (give --world-size N "
            "before --)") in out
    assert ("The command does not shard (--ddp-backend pytorch_ddp): estimated as with "
            "--ddp-backend fully_sharded; as written it runs like the unsharded column") in out
    sharded = [*command, "--ddp-backend=fully_sharded", "--user-dir", str(PLUGIN_DIR),
               "--task", "sharded_translation"]
    for ranks in (["--world-size", "2"], ["--world", "3"], ["--world-size=3"]):
        estimate_main([*ranks, "--", *sharded])
        out = capsys.readouterr().out
        assert "Assumed" not in out and "does not shard" not in out
    # a command that names its ranks is estimated at them
    estimate_main(["--json", "--", *sharded, "--distributed-world-size", "4"])
    report = json.loads(capsys.readouterr().out)
    assert report["setup"]["world_size"] == 4 and report["notes"] == []


def test_a_reader_that_stops_early_gets_no_traceback() -> None:
    done = subprocess.run(
        f"{sys.executable} -c 'from fairseq_shard_plugin.cli.estimate import main; main()' "
        "--arch nllb_dense_3_3b | head -c 10", shell=True, capture_output=True, text=True,
        check=True)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


def test_measure_train_refuses_ranges_it_cannot_profile_and_marks_a_failed_run(
        tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "fairseq-shard-measure-train"
    out = tmp_path / "m-{rank}.json"
    from fairseq_shard_plugin.cli.measure_train import _profile_range

    for given in ("5-2", "1-3", "3-", "a-b"):  # the profile starts at update 2's step
        with pytest.raises(SystemExit) as refused:
            _profile_range(given)
        assert refused.value.code == (
            f"fairseq-shard-measure-train: --profile-updates {given}: give FIRST-LAST, "
            "update numbers from 2 with FIRST not after LAST (e.g. 32-34)")
    assert _profile_range("32-34") == (32, 34) and _profile_range("5") == (5, 5)
    failed = subprocess.run([str(script), "--measure-out", str(out), str(tmp_path), "--arch",
                             "no_such_arch"], capture_output=True, text=True)
    assert failed.returncode == 2
    assert json.loads((tmp_path / "m-0.json").read_text())["completed"] is False


def test_a_configs_update_freq_must_be_whole_numbers(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("optimization:\n  update_freq: [2.5]\n")
    with pytest.raises(EstimateError, match=r"optimization\.update_freq \[2\.5\]: give whole"):
        run(["--config", str(config)])
    config.write_text("optimization:\n  update_freq: [1, 3]\n")
    assert run(["--config", str(config)])["setup"]["update_freq"] == 3
