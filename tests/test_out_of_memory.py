"""A rank that runs out of memory stops the run with one line, instead of a hang.

fairseq would drop the batch on that rank alone and go on, while the other ranks wait in
the step's collectives for it (see ``fairseq_shard_plugin.training.out_of_memory``).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

from fairseq_shard_plugin.checkpoint.space import readable
from fairseq_shard_plugin.memory.estimate import run as run_estimator
from fairseq_shard_plugin.memory.model import GIB
from fairseq_shard_plugin.tasks import register
from fairseq_shard_plugin.training.out_of_memory import smaller_step_advice
from launching.harness import PLUGIN_DIR, REPO, start_ranks, training_args

from tiny_training import TINY, sharded_config

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)

OOM_HELPER = REPO / "tests" / "helpers" / "train_with_oom.py"
STOPPED_WITHIN_S = 120  # a hang would run until this timeout


@pytest.mark.parametrize(("phase", "where", "advice"), [
    ("train", "in training update 4", "lower --max-tokens (512 now)"),
    ("valid", "in validation after update 3", "lower --max-tokens-valid (512 now)"),
])
def test_out_of_memory_on_one_rank_stops_every_rank_with_one_line(
    corpus: Path, tmp_path: Path, phase: str, where: str, advice: str
) -> None:
    command = [sys.executable, str(OOM_HELPER), *training_args(corpus, tmp_path, 6), *TINY,
               "--task", "sharded_translation", "--user-dir", str(PLUGIN_DIR),
               "--ddp-backend", "fully_sharded", "--validate-interval-updates", "3"]
    env = dict(os.environ, INJECT_UPDATE="3", INJECT_PHASE=phase, OMP_NUM_THREADS="1")
    returncode, output = start_ranks(command, 2, env, timeout=STOPPED_WITHIN_S)
    assert returncode == 1, output[-3000:]  # every rank exited by itself: none hung
    errors = [line for line in output.splitlines()
              if line.startswith("fairseq-shard-plugin: error: ")]
    # rank 0 waited for rank 1 in a collective: its line points at rank 1's (it was gloo's
    # traceback)
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in errors if "another rank's process ended" not in line]
    assert len(errors) == 1, output[-3000:]
    assert f"rank 1 ran out of memory {where} (CUDA out of memory." in errors[0]
    assert advice in errors[0]
    assert "attempting to recover from OOM" not in output
    assert "retrying batch" not in output
    if phase == "train":  # the estimator's figure for this step, and the command behind it
        figure, command = re.search(r"fairseq-shard-estimate puts this step at (.+?) per "
                                    r"rank; compare settings with: (.+)$", errors[0]).groups()
        flags = shlex.split(command)[1:]
        assert flags[flags.index("--world-size") + 1] == "2"
        assert "--tokens-per-sentence" in flags  # the failed step's own sentence length
        rerun = run_estimator(flags)["configurations"]["requested"]["peak_gib"]
        assert readable(rerun * GIB) == figure
    assert "predicted peak: " in output  # logged before the first step, on rank 0


def test_the_advice_names_only_settings_that_are_not_on(corpus: Path) -> None:
    plain = smaller_step_advice(sharded_config(
        corpus, "--cpu", "--optimizer", "adam", "--task", "sharded_translation",
        "--criterion", "label_smoothed_cross_entropy", "--max-tokens", "4096"), False)
    assert "--max-tokens (4096 now)" in plain
    for setting in ("--checkpoint-activations", "chunked_label_smoothed_cross_entropy",
                    "--cpu-offload"):
        assert setting in plain
    lean = smaller_step_advice(sharded_config(
        corpus, "--cpu", "--optimizer", "adam", "--task", "sharded_translation",
        "--criterion", "chunked_label_smoothed_cross_entropy", "--checkpoint-activations",
        "--cpu-offload", "--max-tokens", "4096"), False)
    for setting in ("--checkpoint-activations", "chunked_label_smoothed_cross_entropy",
                    "--cpu-offload"):
        assert setting not in lean
    assert "--max-tokens (4096 now)" in lean


def test_the_advice_leaves_out_settings_the_model_cannot_take(corpus: Path) -> None:
    """An LSTM has no --checkpoint-activations and cannot take the chunked loss: neither is
    advised, so the line never sends a user to a flag that is then refused."""
    register()
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(
        options.get_training_parser(), [
            str(corpus), "--arch", "lstm", "--encoder-embed-dim", "32",
            "--decoder-embed-dim", "32", "--decoder-out-embed-dim", "32",
            "--ddp-backend", "fully_sharded", "--cpu", "--optimizer", "adam", "--task",
            "sharded_translation", "--criterion", "label_smoothed_cross_entropy",
            "--max-tokens", "4096"]))
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    advice = smaller_step_advice(cfg, False, model)
    assert "--checkpoint-activations" not in advice
    assert "chunked_label_smoothed_cross_entropy" not in advice
    assert "--max-tokens (4096 now)" in advice and "--cpu-offload" in advice
