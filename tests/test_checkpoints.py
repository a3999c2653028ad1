"""Checkpoints on 2 gloo CPU ranks: crash safety (SIGKILL on every rank) and exact resume."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import BinaryIO

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
from fairseq_shard_plugin import consolidate
from fairseq_shard_plugin.atomic_files import remove_partial_files, write_atomically

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
        "--task", "sharded_translation", "--save-interval-updates", "10", *extra]


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
    export = save_dir / "export" / "model.pt"
    run = run_training(args(corpus, save_dir, "--export-consolidated", str(export)), nproc=2,
                       plugin=True)
    return run, save_dir


@pytest.fixture(scope="module")
def crashes(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Killed right after the update-20 save; resumed, and killed inside the update-30 save."""
    save_dir = tmp_path_factory.mktemp("crashed")
    after_save = crash_training("after-save", 20, args(corpus, save_dir))
    last_bytes = (save_dir / "checkpoint_last.pt").read_bytes()
    during_copy = crash_training("during-copy", 30, args(corpus, save_dir))
    return {"after_save": after_save, "during_copy": during_copy, "save_dir": save_dir,
            "last_after_first_crash": last_bytes}


def test_sigkill_after_a_save_keeps_that_checkpoint(crashes: dict) -> None:
    run = crashes["after_save"]
    assert run.returncode != 0 and "Signal 9" in run.output, run.output[-3000:]
    assert run.series("train_inner", "num_updates")[-1] == 20  # killed before update 21
    first = crashes["save_dir"] / "checkpoint_1_20.pt"
    assert crashes["last_after_first_crash"] == first.read_bytes()
    assert saved_update(first) == 20


def test_sigkill_during_the_copy_to_checkpoint_last_keeps_the_previous_one(
    crashes: dict,
) -> None:
    run, save_dir = crashes["during_copy"], crashes["save_dir"]
    assert run.returncode != 0 and "Signal 9" in run.output, run.output[-3000:]
    assert "Loaded checkpoint" in run.output
    assert run.series("train_inner", "num_updates") == [float(n) for n in range(21, 31)]
    # The kill really hit the copy: its half-written temporary file is still there ...
    leftovers = list(save_dir.glob(".checkpoint_last.pt.partial-*"))
    update_30 = save_dir / "checkpoint_1_30.pt"
    assert leftovers and 0 < leftovers[0].stat().st_size < update_30.stat().st_size
    # ... while checkpoint_last.pt is still, byte for byte, the update-20 checkpoint, which
    # the next run resumes from; the update-30 file written before the copy is complete.
    assert (save_dir / "checkpoint_last.pt").read_bytes() == crashes["last_after_first_crash"]
    assert saved_update(update_30) == 30


def test_resume_after_a_crash_reproduces_the_uninterrupted_losses(
    crashes: dict, uninterrupted: tuple[RunResult, Path]
) -> None:
    reference = uninterrupted[0].series("train_inner", "loss")
    assert len(reference) == UPDATES
    assert crashes["after_save"].series("train_inner", "loss") == reference[:20]
    assert crashes["during_copy"].series("train_inner", "loss") == reference[20:30]


def test_an_interrupted_write_leaves_the_old_file_and_is_cleaned_up(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint_last.pt"
    target.write_bytes(b"complete old checkpoint")

    def fail_halfway(out: BinaryIO) -> None:
        out.write(b"half of a new one")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, fail_halfway)
    assert target.read_bytes() == b"complete old checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_last.pt"]
    leftover = tmp_path / ".checkpoint_1_30.pt.partial-999"  # as a SIGKILL leaves it
    leftover.write_bytes(b"half")
    assert remove_partial_files(tmp_path) == [leftover]
    assert not leftover.exists() and target.exists()


def translations(corpus: Path, checkpoint: Path) -> list[str]:
    """Hypotheses of ``fairseq-generate --path checkpoint`` on the test set."""
    generated = subprocess.run(
        [tool("fairseq-generate"), str(corpus), "--path", str(checkpoint),
         "--user-dir", str(PLUGIN_DIR), "--cpu", "--beam", "2", "--max-tokens", "1000",
         "--max-len-b", "20"],
        capture_output=True, text=True, timeout=300,
    )
    assert generated.returncode == 0, generated.stderr[-3000:]
    found = re.search(r"Translated (\d+) sentences", generated.stderr + generated.stdout)
    hypotheses = [line for line in generated.stdout.splitlines() if line.startswith("H-")]
    assert found and len(hypotheses) == int(found.group(1)) > 0
    return hypotheses


def test_export_at_end_of_training_is_a_standard_inference_checkpoint(
    corpus: Path, uninterrupted: tuple[RunResult, Path]
) -> None:
    _, save_dir = uninterrupted
    export_path = save_dir / "export" / "model.pt"
    exported = torch.load(export_path, weights_only=True)
    final = torch.load(save_dir / "checkpoint_last.pt", weights_only=True)
    assert "last_optimizer_state" not in exported
    assert final["optimizer_history"][-1]["num_updates"] == UPDATES
    assert exported["model"].keys() == final["model"].keys()
    for name, tensor in exported["model"].items():  # the gathered full fp32 weights
        assert type(tensor) is torch.Tensor and tensor.dtype == torch.float32, name
        assert torch.equal(tensor, final["model"][name]), name
    assert export_path.stat().st_size < 0.6 * (save_dir / "checkpoint_last.pt").stat().st_size
    translations(corpus, export_path)


def test_consolidate_command_writes_16_bit_weights_that_from_pretrained_loads(
    corpus: Path, uninterrupted: tuple[RunResult, Path], tmp_path: Path
) -> None:
    _, save_dir = uninterrupted
    out = tmp_path / "model16.pt"
    consolidate.main([str(save_dir), str(out), "--fp16"])  # fairseq-shard-consolidate
    exported = torch.load(out, weights_only=True)
    final = torch.load(save_dir / "checkpoint_last.pt", weights_only=True)
    for name, tensor in exported["model"].items():
        assert tensor.dtype == torch.float16, name
        assert torch.equal(tensor, final["model"][name].half()), name

    from fairseq.models.transformer import TransformerModel

    import fairseq_shard_plugin  # noqa: F401  (the user dir: allows the config's types)

    hub = TransformerModel.from_pretrained(str(tmp_path), checkpoint_file=out.name,
                                           data_name_or_path=str(corpus))
    embedding = hub.models[0].encoder.embed_tokens.weight
    assert torch.equal(embedding, final["model"]["encoder.embed_tokens.weight"].half().float())
    source = (corpus.parent / "raw" / "test.src").read_text().splitlines()[0]
    assert hub.translate(source, beam=2).split()


def test_consolidate_refuses_a_truncated_checkpoint_in_one_line(
    uninterrupted: tuple[RunResult, Path], tmp_path: Path
) -> None:
    whole = (uninterrupted[1] / "checkpoint_last.pt").read_bytes()
    (tmp_path / "checkpoint_last.pt").write_bytes(whole[: len(whole) // 3])
    with pytest.raises(SystemExit) as stopped:
        consolidate.main([str(tmp_path), str(tmp_path / "out.pt")])
    message = str(stopped.value.code)
    assert "\n" not in message and message.startswith("fairseq-shard-consolidate: error: ")
    assert "checkpoint_last.pt: unreadable checkpoint" in message and "truncated" in message
    assert not (tmp_path / "out.pt").exists()
