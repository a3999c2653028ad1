"""``--shard-engine fairscale``: the plan's structure on 2 CPU ranks; training on CUDA only.

fairscale FSDP constructs on CPU (``compute_device=cpu``, gloo) but runs forward and
backward on CUDA streams, so its structure is tested here and its training is skipped,
with the reason, where no CUDA device exists.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from fairseq_shard_plugin.checkpoint.safe_loading import allow_fairseq_checkpoint_types
from fairseq_shard_plugin.training.validation import ShardingConfigError, check_fairscale_engine
from launching.harness import (
    PLUGIN_DIR,
    REPO,
    run_command,
    run_helper,
    run_training,
    tool,
    training_args,
)

from tiny_training import TINY, sharded_config

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)

VARIANTS = {
    "fp32": [],
    "fp16": ["--fp16"],
    "bf16_16bit_reduce_root_kept_checkpointed": [
        "--bf16", "--reduce-in-16-bit", "--keep-root-gathered", "--checkpoint-activations"],
}
LAYERS = ["encoder.layers.0", "encoder.layers.1", "decoder.layers.0", "decoder.layers.1"]
VOCABULARY = "encoder.embed_tokens+decoder.output_projection"
NO_CUDA = "--shard-engine fairscale trains only on CUDA (fairscale FSDP uses CUDA streams)"


@pytest.fixture(scope="module")
def reports(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("fairscale_structure")
    run_helper(REPO / "tests" / "helpers" / "inspect_fairscale.py", str(out),
               json.dumps(VARIANTS), str(corpus), *TINY, "--task", "sharded_translation",
               "--shard-engine", "fairscale", "--optimizer", "adam", "--lr", "1e-3",
               "--cpu", "--ddp-backend", "fully_sharded")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_each_unit_is_one_flat_fsdp_instance_holding_its_half(reports: list[dict]) -> None:
    for report in reports:
        for variant in VARIANTS:
            result = report[variant]
            assert result["layers_are_units"]
            assert set(result["units"]) == {"<root>", VOCABULARY, *LAYERS}
            for name, unit in result["units"].items():
                assert unit["flatten_parameters"], name
                assert unit["slice_matches"], (variant, name)
                assert unit["local_numel"] == (unit["full_numel"] + 1) // 2, name
            assert result["held_fraction"] == pytest.approx(0.5, abs=0.01)


def test_tied_vocabulary_is_sharded_once_and_used_by_the_projection(
    reports: list[dict],
) -> None:
    for report in reports:
        for variant in VARIANTS:
            tie = report[variant]["tie"]
            assert tie["vocabulary_units"] == 1 and tie["projection_uses_it"]
            assert tie["projection_params"] == 0
            assert tie["tied_keys"] == {
                "decoder.output_projection.weight": "encoder.embed_tokens.weight"}
            assert report[variant]["units"][VOCABULARY]["module"] == "TiedEmbedding"


@pytest.mark.parametrize(
    ("variant", "dtype", "fp32_reduce", "root_reshards"),
    [
        ("fp32", "torch.float32", False, True),
        ("fp16", "torch.float16", True, True),
        ("bf16_16bit_reduce_root_kept_checkpointed", "torch.bfloat16", False, False),
    ],
)
def test_precision_and_resharding_follow_the_flags(
    reports: list[dict], variant: str, dtype: str, fp32_reduce: bool, root_reshards: bool
) -> None:
    units = reports[0][variant]["units"]
    for name, unit in units.items():
        assert unit["mixed_precision"] == (variant != "fp32"), name
        assert unit["compute_dtype"] == dtype, name
        assert unit["fp32_reduce_scatter"] == fp32_reduce, name
        expected = root_reshards if name == "<root>" else True
        assert unit["reshard_after_forward"] == expected, name


def test_activation_checkpointing_is_fairscales_wrapper_once(reports: list[dict]) -> None:
    asked = reports[0]["bf16_16bit_reduce_root_kept_checkpointed"]
    assert asked["layers_checkpointed_by_fairseq_before"] == [True] * 4
    assert asked["layers_checkpointed"] == [True] * 4
    assert reports[0]["fp16"]["layers_checkpointed"] == [False] * 4


def test_grad_norm_and_optimizer_state_round_trips_over_flat_shards(
    reports: list[dict],
) -> None:
    for report in reports:
        for variant in VARIANTS:
            norm = report[variant]["grad_norm"]
            assert norm["sharded"] == pytest.approx(norm["unsharded"], rel=1e-5)
            state = report[variant]["optimizer_state"]
            assert state["gathered_is_full"] and state["reloaded_is_local_slice"]


@pytest.mark.parametrize(("variant", "tolerance"), [
    ("fp32", 1e-5), ("fp16", 1e-3), ("bf16_16bit_reduce_root_kept_checkpointed", 1e-3)])
def test_sharded_step_matches_the_unsharded_model(
    reports: list[dict], variant: str, tolerance: float
) -> None:
    """One batch, with fairscale's CUDA stream calls as CPU no-ops (tests/helpers/cpu_streams):
    the tied projection, 16-bit compute, resharding and re-gathering give the unsharded
    model's loss and gradient norm."""
    for report in reports:
        step = report[variant]["step"]
        for attempt in (0, 1):
            assert step[f"loss{attempt}"] == pytest.approx(step["reference_loss"], rel=tolerance)
            assert step[f"norm{attempt}"] == pytest.approx(step["reference_norm"], rel=tolerance)
        assert (step["loss0"], step["norm0"]) == (step["loss1"], step["norm1"])


@pytest.mark.parametrize(("flags", "named"), [
    (["--cpu-offload"], "--cpu-offload is not supported with --shard-engine fairscale"),
    (["--shard-strategy", "hybrid"], "--shard-strategy hybrid is not supported"),
    (["--criterion", "chunked_label_smoothed_cross_entropy"],
     "--criterion chunked_label_smoothed_cross_entropy is not supported"),
    (["--eval-bleu"], "--eval-bleu (generation in validation) is not supported"),
    (["--layers-per-unit", "2"], "--layers-per-unit above 1 is not supported"),
    (["--cpu"], "--shard-engine fairscale needs CUDA (fairscale FSDP runs on CUDA streams) and "
                "--cpu was given: use --shard-engine fsdp2"),
])
def test_fsdp2_only_flags_and_cpu_are_named(corpus: Path, flags: list[str], named: str) -> None:
    cfg = sharded_config(corpus, "--task", "sharded_translation", "--shard-engine", "fairscale",
                         "--optimizer", "adam", *flags)
    with pytest.raises(ShardingConfigError, match=re.escape(named)):
        check_fairscale_engine(cfg)


def test_refused_without_cuda_before_training(corpus: Path, tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal needs a CPU-only run")
    save_dir = tmp_path / "save"
    command = [tool("fairseq-train"), *training_args(corpus, save_dir, 2), *TINY,
               "--user-dir", str(PLUGIN_DIR), "--ddp-backend", "fully_sharded",
               "--task", "sharded_translation", "--shard-engine", "fairscale"]
    completed = run_command(command)
    assert completed.returncode != 0
    last_line = completed.stderr.strip().splitlines()[-1]
    assert last_line.startswith("fairseq-shard-plugin: error: --shard-engine fairscale needs CUDA")
    assert "use --shard-engine fsdp2" in last_line
    assert not save_dir.exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA + "; no CUDA device here")
def test_fp16_training_and_resume_on_cuda(corpus: Path, tmp_path: Path) -> None:
    base = training_args(corpus, tmp_path, 10, cpu=False)
    args = base + TINY + [
        "--task", "sharded_translation", "--shard-engine", "fairscale", "--fp16"]
    first = run_training(args, nproc=1, plugin=True)
    losses = first.series("train_inner", "loss")
    assert len(losses) == 10 and losses[-1] < losses[0]
    model = _load_checkpoint(tmp_path / "checkpoint_last.pt")["model"]
    assert torch.equal(model["decoder.output_projection.weight"],
                       model["encoder.embed_tokens.weight"])
    assert all(t.dtype == torch.float32 for t in model.values() if t.is_floating_point())
    resumed = run_training(training_args(corpus, tmp_path, 15, cpu=False) + args[len(base):],
                           nproc=1, plugin=True)
    assert len(resumed.series("train_inner", "loss")) == 5


def _load_checkpoint(path: Path) -> dict[str, Any]:
    allow_fairseq_checkpoint_types()
    return torch.load(path, map_location="cpu", weights_only=True)
