"""Checkpoints on gloo CPU ranks: crash safety (SIGKILL on every rank), exact resume,
sharded (DCP) save and reload on other world sizes, consolidated export, checkpoints
written by stock fairseq, and refusals of damaged or mismatched files.

Module fixtures share the launches: an uninterrupted 40-update run (full checkpoints, with
the end-of-training export) is the reference; a sharded-format run killed right after its
update-20 save and its resume killed inside the update-30 save must reproduce its losses
exactly; a stock fairseq run provides a standard checkpoint; helpers reload them all on 4
and then 1 rank.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath
from typing import BinaryIO

import pytest
import torch

from fairseq_shard_plugin.checkpoint import consolidate, verify
from fairseq_shard_plugin.checkpoint.atomic_files import (
    WriteError,
    remove_partial_files,
    write_atomically,
)
from fairseq_shard_plugin.checkpoint.reading import read_checkpoint
from fairseq_shard_plugin.checkpoint.sharded import (
    MARKER,
    MARKER_HEADER,
    SHARDS_DIR,
    is_plugin_shard_directory,
    mark_as_shard_directory,
    remove_unreferenced_shards,
    save_sharded,
    shard_directory,
)
from fairseq_shard_plugin.checkpoint.space import space_report
from fairseq_shard_plugin.cli import consolidate as cli_consolidate
from fairseq_shard_plugin.cli import verify as cli_verify
from launching.harness import (
    PLUGIN_DIR,
    REPO,
    RunResult,
    free_port,
    parse_logs,
    run_command,
    run_concurrently,
    run_training,
    start_ranks,
    tool,
    training_args,
)

from tiny_training import SHARDED, TINY, reshard, sharded_config

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)

UPDATES = 40
TIED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
        "decoder.output_projection.weight")  # one parameter: --share-all-embeddings
# 128 tokens per rank: an epoch is longer than 40 updates, so the crash resumes below land
# in epoch 1; test_a_signal_to_one_rank_stops_all_and_the_resume_in_epoch_2_continues_exactly
# resumes in epoch 2 (see resumable_batches.py for why stock fairseq is not exact there).
MAX_TOKENS = 128
CRASH_HELPER = REPO / "tests" / "helpers" / "crash_training.py"
FULL_DISK_HELPER = REPO / "tests" / "helpers" / "train_with_full_disk.py"


def args(corpus: Path, save_dir: Path, *extra: str, updates: int = UPDATES) -> list[str]:
    return training_args(corpus, save_dir, updates, max_tokens=MAX_TOKENS) + TINY + [
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


def flip_middle_byte(path: Path) -> None:
    """Damage a file's content without changing its length (a bad disk or copy)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def equal_models(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[RunResult, Path]:
    save_dir = tmp_path_factory.mktemp("uninterrupted")
    export = save_dir / "export" / "model.pt"
    run = run_training(args(corpus, save_dir, "--export-consolidated", str(export)), nproc=2,
                       plugin=True)
    return run, save_dir


@pytest.fixture(scope="module")
def crashes(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Sharded checkpoints; killed right after the update-20 save; resumed, and killed
    inside the update-30 save (half-way through the copy to checkpoint_last.pt)."""
    save_dir = tmp_path_factory.mktemp("crashed")
    # the shards go to a "scratch disk" through a symlink, beside a user's own directories
    scratch = tmp_path_factory.mktemp("scratch")
    for name in ("photos", "u5-abc"):
        (scratch / name).mkdir()
        (scratch / name / "kept.txt").write_text(name)
    (save_dir / SHARDS_DIR).symlink_to(scratch)
    after_save = crash_training("after-save", 20, args(corpus, save_dir, *SHARDED))
    first = {p.name: p.read_bytes() for p in save_dir.glob("*.pt")}
    first_shards = sorted(p.name for p in (save_dir / SHARDS_DIR).iterdir()
                          if is_plugin_shard_directory(p, save_dir))
    # resumed with fairseq's own flag for per-rank files, which the recipes pass: the same
    # format (fairseq's `-shard0` names would not find the update-20 checkpoint)
    during_copy = crash_training("during-copy", 30, args(corpus, save_dir,
                                                         "--use-sharded-state"))
    return {"after_save": after_save, "during_copy": during_copy, "save_dir": save_dir,
            "files_after_first_crash": first, "shards_after_first_crash": first_shards,
            "scratch": scratch}


def test_shards_on_a_symlinked_scratch_disk_train_resume_and_leave_its_other_files(
    crashes: dict,
) -> None:
    scratch = crashes["scratch"]
    assert "Loaded checkpoint" in crashes["during_copy"].output
    assert crashes["during_copy"].output.count(
        "--use-sharded-state: checkpoints in the plugin's sharded format") == 1
    assert not list(crashes["save_dir"].glob("*-shard*.pt"))
    for name in ("photos", "u5-abc"):
        assert (scratch / name / "kept.txt").read_text() == name
    assert {p.name.split("-")[0] for p in scratch.iterdir()} >= {"u10", "u20", "u30"}


def test_sigkill_after_a_save_keeps_that_checkpoint(crashes: dict) -> None:
    run, first = crashes["after_save"], crashes["files_after_first_crash"]
    assert run.returncode != 0 and "Signal 9" in run.output, run.output[-3000:]
    assert run.series("train_inner", "num_updates")[-1] == 20  # killed before update 21
    assert first["checkpoint_last.pt"] == first["checkpoint_1_20.pt"]
    assert saved_update(crashes["save_dir"] / "checkpoint_1_20.pt") == 20


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
    # the next run resumes from; the update-30 checkpoint written before the copy is whole.
    last = (save_dir / "checkpoint_last.pt").read_bytes()
    assert last == crashes["files_after_first_crash"]["checkpoint_1_20.pt"]
    assert saved_update(update_30) == 30
    assert consolidate.read_full_state(update_30)["optimizer_history"][-1]["num_updates"] == 30


def test_resume_after_a_crash_reproduces_the_uninterrupted_losses(
    crashes: dict, uninterrupted: tuple[RunResult, Path]
) -> None:
    reference = uninterrupted[0].series("train_inner", "loss")
    assert len(reference) == UPDATES
    assert crashes["after_save"].series("train_inner", "loss") == reference[:20]
    assert crashes["during_copy"].series("train_inner", "loss") == reference[20:30]


@pytest.fixture(scope="module")
def sixteen_updates(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """16 updates in 2 epochs, uninterrupted: the reference of the signal tests."""
    save_dir = tmp_path_factory.mktemp("sixteen_updates")
    return run_training(training_args(corpus, save_dir, 16, max_tokens=1024) + TINY + [
        "--task", "sharded_translation", "--no-epoch-checkpoints"], nproc=2, plugin=True)


@pytest.mark.parametrize("no_last", [(), ("--no-last-checkpoints",)],
                         ids=["", "no-last-checkpoints"])
def test_a_signal_to_one_rank_stops_all_and_the_resume_in_epoch_2_continues_exactly(
    corpus: Path, tmp_path: Path, sixteen_updates: RunResult, no_last: tuple[str, ...]
) -> None:
    """Slurm-style preemption: SIGUSR1 to rank 1 only, during update 9 or 10. Every rank
    saves after the same update and exits with 128 + SIGUSR1; the same command resumes
    with the losses of a run that was never stopped. 1,024 tokens per rank make an epoch
    about 8 updates, so this resume is in epoch 2, where stock fairseq would build other
    batches than the uninterrupted run holds (see resumable_batches.py). Under
    --no-last-checkpoints the signal's save still writes checkpoint_last.pt (it wrote
    nothing, and the "resume" started from scratch)."""
    def fairseq_args(save_dir: Path) -> list[str]:
        return training_args(corpus, save_dir, 16, max_tokens=1024) + TINY + [
            "--task", "sharded_translation", "--no-epoch-checkpoints", *no_last]

    sent: list[int] = []

    def preempt_rank_1(ranks: list[subprocess.Popen], outputs: list[str]) -> None:
        if not sent and '"num_updates": "9"' in outputs[0]:
            os.kill(ranks[1].pid, signal.SIGUSR1)
            sent.append(signal.SIGUSR1)

    reference = sixteen_updates
    save_dir = tmp_path / "preempted"
    stopped = run_training(fairseq_args(save_dir), nproc=2, plugin=True, check=False,
                           watch=preempt_rank_1)
    assert stopped.returncode == 128 + signal.SIGUSR1, stopped.output[-3000:]
    last = int(stopped.series("train_inner", "num_updates")[-1])
    assert 9 <= last < 16
    # rank 0 logs; it got no signal itself, so the ranks agreed
    assert f"SIGUSR1: saving a checkpoint after update {last}, then stopping" in stopped.output
    assert ("despite --no-last-checkpoints" in stopped.output) == bool(no_last)
    state = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == last
    assert state["extra_state"]["train_iterator"]["epoch"] == 2, "the stop should be in epoch 2"
    resumed = run_training(fairseq_args(save_dir), nproc=2, plugin=True)
    assert resumed.series("train_inner", "num_updates") == [float(n) for n in range(last + 1, 17)]
    losses = stopped.series("train_inner", "loss") + resumed.series("train_inner", "loss")
    assert losses == reference.series("train_inner", "loss")



SIGNAL_HELPER = REPO / "tests" / "helpers" / "signal_during_update.py"


@pytest.mark.parametrize("last_epoch", [False, True], ids=["epoch-1-of-2", "last-epoch"])
def test_a_signal_during_an_epochs_last_update_validates_the_epoch_first(
    corpus: Path, tmp_path: Path, sixteen_updates: RunResult, last_epoch: bool
) -> None:
    """SIGUSR1 during the update that ends an epoch: the signal's save stopped the run before
    the epoch's validation, which the resumed run (next epoch) never made, so
    checkpoint_best.pt stayed on an older update (T2 #2). The epoch is validated first; at
    the end of the last epoch (--max-epoch) the run ends as usual, exit code 0."""
    epoch_end = int(sixteen_updates.logs["train"][0]["train_num_updates"])
    args = [*training_args(corpus, tmp_path, 16, max_tokens=1024), *TINY,
            "--task", "sharded_translation", "--no-epoch-checkpoints",
            "--max-epoch", "1" if last_epoch else "3",
            "--user-dir", str(PLUGIN_DIR), "--ddp-backend", "fully_sharded"]
    error_file = tmp_path / "error.json"  # torchrun's, for its closing summary
    env = dict(os.environ, SIGNAL_UPDATE=str(epoch_end), OMP_NUM_THREADS="1",
               TORCHELASTIC_ERROR_FILE=str(error_file))
    returncode, output = start_ranks([sys.executable, str(SIGNAL_HELPER), *args], 2, env,
                                     timeout=300)
    assert returncode == (0 if last_epoch else 128 + signal.SIGUSR1), output[-3000:]
    # a requested stop, not a crash, in torchrun's "Root Cause" (T2 #9)
    assert error_file.exists() != last_epoch
    assert last_epoch or ("fairseq-shard-plugin: stopped on SIGUSR1 (exit code 138) after "
                          "saving checkpoint_last.pt: the same command resumes"
                          ) in error_file.read_text()
    valid = parse_logs(output)["valid"]
    assert [int(entry["valid_num_updates"]) for entry in valid] == [epoch_end], output[-3000:]
    assert valid[0]["valid_loss"] == sixteen_updates.logs["valid"][0]["valid_loss"]
    best = torch.load(tmp_path / "checkpoint_best.pt", map_location="cpu", weights_only=True)
    assert best["optimizer_history"][-1]["num_updates"] == epoch_end
    if not last_epoch:  # said in the log too; the resume goes on in epoch 2 exactly
        assert (f"SIGUSR1: stopping after update {epoch_end}, the end of epoch 1, validated "
                "and saved (exit code 138)") in output
        resumed = run_training(args[:-4], nproc=2, plugin=True)
        assert resumed.series("train_inner", "num_updates")[0] == epoch_end + 1
        losses = parse_logs(output)["train_inner"] + resumed.logs["train_inner"]
        assert [float(entry["loss"]) for entry in losses] == sixteen_updates.series(
            "train_inner", "loss")

def test_an_interrupted_write_leaves_the_old_file_and_is_cleaned_up(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint_last.pt"
    target.write_bytes(b"complete old checkpoint")

    def fail_halfway(out: BinaryIO) -> None:
        out.write(b"half of a new one")
        raise OSError("disk full")

    with pytest.raises(WriteError, match=f"could not write {target}: disk full; "
                       "checkpoint_last.pt is unchanged"):
        write_atomically(target, fail_halfway)
    assert target.read_bytes() == b"complete old checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_last.pt"]
    leftover = tmp_path / f".checkpoint_1_30.pt.partial-{ended_process()}-0123456789ab"
    leftover.write_bytes(b"half")  # as a SIGKILL leaves it
    assert remove_partial_files(tmp_path) == [leftover]
    assert not leftover.exists() and target.exists()


def test_a_write_never_goes_through_a_link_planted_under_a_temporary_name(
    tmp_path: Path,
) -> None:
    """Someone who can write to the output directory plants symlinks under every name the
    temporary file could have had before: the victim file stays as it was."""
    victim, target = tmp_path / "victim.txt", tmp_path / "out" / "model.pt"
    victim.write_text("precious")
    target.parent.mkdir()
    for pid in range(os.getpid() - 5, os.getpid() + 5):
        (target.parent / f".model.pt.partial-{pid}").symlink_to(victim)
    write_atomically(target, lambda out: out.write(b"exported"))
    assert victim.read_text() == "precious" and target.read_bytes() == b"exported"
    assert not target.is_symlink()
    # the links are not under names this plugin writes: a save leaves them and their target
    remove_partial_files(target.parent)
    assert victim.read_text() == "precious" and (target.parent / "model.pt").is_file()


def test_a_write_removes_the_temporary_files_of_its_killed_predecessors_only(
    tmp_path: Path,
) -> None:
    """A killed export leaves .model.pt.partial-PID-*; the next write of model.pt removes
    it, but not a live process's write in progress, nor other names' files."""
    dead, alive = ended_process(), os.getpid()
    kept = [f".model.pt.partial-{alive}-2c3d4e5f6a7b", f".other.pt.partial-{dead}-4e5f6a7b8c9d",
            f".model.pt.partial-{dead}", ".model.pt.partial-keep"]  # the last two: not ours
    for name in [f".model.pt.partial-{dead}-0a1b2c3d4e5f", *kept]:
        (tmp_path / name).write_bytes(b"half")
    write_atomically(tmp_path / "model.pt", lambda out: out.write(b"whole"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model.pt", *kept])


def test_a_save_removes_only_the_leftovers_of_killed_writes_from_its_directory(
    tmp_path: Path,
) -> None:
    """A save cleans its directory of this plugin's temporary files whose process is gone;
    an export still being written beside the run (a live process's temporary file) and
    other programs' files that look alike stay (they were deleted, and exports failed)."""
    dead, alive = ended_process(), os.getpid()
    removed = [tmp_path / f".checkpoint_2_40.pt.partial-{dead}-0a1b2c3d4e5f",
               tmp_path / f".model.pt.partial-{dead}-ffffffffffff"]
    kept = [f".model.pt.partial-{alive}-0a1b2c3d4e5f", ".rsync-notes.partial-keep",
            f".notes.partial-{dead}", f".model.pt.partial-{dead}-0A1B2C3D4E5F"]
    for path in [*removed, *(tmp_path / name for name in kept)]:
        path.write_bytes(b"half")
    assert sorted(remove_partial_files(tmp_path)) == sorted(removed)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def test_temporary_files_written_on_another_host_or_namespace_are_never_judged_here(
    tmp_path: Path,
) -> None:
    """A save dir shared by nodes (or containers): a process id means another process
    there, so a live export's temporary file written elsewhere was deleted as a dead one's
    (found with an export from another PID namespace)."""
    from fairseq_shard_plugin.checkpoint.atomic_files import _create_partial_file, _this_place

    dead = ended_process()
    other = "0123abcd" if _this_place() != "0123abcd" else "4567cdef"
    ours = tmp_path / f".model.pt.partial-{dead}@{_this_place()}-0a1b2c3d4e5f"
    elsewhere = tmp_path / f".model.pt.partial-{dead}@{other}-0a1b2c3d4e5f"
    for path in (ours, elsewhere):
        path.write_bytes(b"half")
    assert remove_partial_files(tmp_path) == [ours]
    assert elsewhere.exists()
    # a training holding its save dir removes what killed saves of its own names left,
    # from any place (a job requeued on another node, or in a new container)
    # (this place's are judged by their process: a live export here keeps its file)
    killed_save = tmp_path / f".checkpoint_last.pt.partial-{os.getpid()}@{other}-0a1b2c3d4e5f"
    live_here = tmp_path / f".checkpoint_b.pt.partial-{os.getpid()}@{_this_place()}-0a1b2c3d4e5f"
    for path in (killed_save, live_here):
        path.write_bytes(b"half")
    assert remove_partial_files(tmp_path) == []
    assert remove_partial_files(tmp_path, lambda name: name.startswith("checkpoint_")) == [
        killed_save]
    assert elsewhere.exists() and live_here.exists()
    temporary, out = _create_partial_file(tmp_path / "model.pt")  # what a write names
    out.close()
    assert temporary.name.startswith(f".model.pt.partial-{os.getpid()}@{_this_place()}-")


def ended_process() -> int:
    """The process id of a process that has ended."""
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
    return int(finished.stdout)


@pytest.mark.parametrize("checkpoint_format", ["sharded", "full"])
def test_a_full_disk_stops_the_run_in_one_line_and_keeps_the_saved_checkpoints(
    corpus: Path, tmp_path: Path, checkpoint_format: str
) -> None:
    """The save at update 6 fails (the disk filled after update 4; see the helper): every
    rank stops with the same line instead of waiting for the failed one (or dying on a
    broken connection), the line says what to do, and the update-3 checkpoints are intact
    with nothing half-written beside them. In the sharded format every rank writes (DCP)
    and a failed save leaves a shard directory; in the full format rank 0 alone writes."""
    command = [sys.executable, str(FULL_DISK_HELPER),
               *training_args(corpus, tmp_path, 6), *TINY, "--task", "sharded_translation",
               "--save-interval-updates", "3", "--checkpoint-format", checkpoint_format,
               "--user-dir", str(PLUGIN_DIR), "--ddp-backend", "fully_sharded"]
    env = dict(os.environ, FULL_AFTER_UPDATE="4", FILE_LIMIT=str(512 * 1024),
               OMP_NUM_THREADS="1")
    returncode, output = start_ranks(command, 2, env, timeout=120)
    assert returncode == 1, output[-3000:]
    errors = [line for line in output.splitlines()
              if line.startswith("fairseq-shard-plugin: error: could not write ")]
    assert len(errors) == 2 and len(set(errors)) == 1, output[-3000:]  # every rank, one line
    assert "File too large (EFBIG)" in errors[0], output[-3000:]
    smaller = ("train on more ranks (a smaller shard file each)" if checkpoint_format == "sharded"
               else "save with --checkpoint-format sharded (a smaller file per rank)")
    assert (f"raise it, give a --save-dir on another file system, or {smaller}, and run the "
            "same command again: it resumes") in errors[0]
    assert "Traceback" not in output, output[-3000:]
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert names == ["checkpoint_1_3.pt", "checkpoint_best.pt", "checkpoint_last.pt"]
    assert saved_update(tmp_path / "checkpoint_last.pt") == 3
    assert all(verify.check(tmp_path / name).intact for name in names)
    if checkpoint_format == "sharded":  # the failed save's directory removed
        assert len(list((tmp_path / "checkpoint_shards").iterdir())) == 1


def test_one_ranks_disk_filling_inside_torchs_writer_stops_every_rank_in_one_line(
    corpus: Path, tmp_path: Path
) -> None:
    """Rank 1's scratch disk fills (a 4 KiB file limit) while torch's C++ zip writer writes
    its shard: the system's error stays inside the writer, which reports a short write, and
    every rank ended in DCP's traceback. Now the same line on every rank, as for a full
    disk, and the update-3 checkpoints intact."""
    command = [sys.executable, str(FULL_DISK_HELPER),
               *training_args(corpus, tmp_path, 6), *TINY, "--task", "sharded_translation",
               "--save-interval-updates", "3", "--checkpoint-format", "sharded",
               "--user-dir", str(PLUGIN_DIR), "--ddp-backend", "fully_sharded"]
    env = dict(os.environ, FULL_AFTER_UPDATE="4", FILE_LIMIT="4096", FULL_ON_RANK="1",
               OMP_NUM_THREADS="1")
    returncode, output = start_ranks(command, 2, env, timeout=120)
    assert returncode == 1, output[-3000:]
    errors = {line for line in output.splitlines()
              if line.startswith("fairseq-shard-plugin: error: could not write the shards")}
    assert len(errors) == 1, output[-3000:]
    line = errors.pop()
    assert "(a short write: " in line and "as on a full disk or past a file size limit" in line
    assert f"Free space in {tmp_path} (or, where a file size limit stopped it" in line
    assert "Traceback" not in output, output[-3000:]
    assert saved_update(tmp_path / "checkpoint_last.pt") == 3
    assert len(list((tmp_path / "checkpoint_shards").iterdir())) == 1


def test_a_rank_whose_peer_was_killed_ends_in_one_line(corpus: Path, tmp_path: Path) -> None:
    """Rank 1 is killed (SIGKILL) as update 3 starts: rank 0 learned it inside its next
    collective and printed gloo's 60-line traceback; now one line naming what happened."""
    command = [sys.executable, str(REPO / "tests" / "helpers" / "rank_killed.py"),
               *training_args(corpus, tmp_path, 6), *TINY, "--task", "sharded_translation",
               "--user-dir", str(PLUGIN_DIR), "--ddp-backend", "fully_sharded"]
    env = dict(os.environ, KILLED_RANK="1", KILL_AT_UPDATE="3", OMP_NUM_THREADS="1")
    returncode, output = start_ranks(command, 2, env, timeout=120)
    assert returncode != 0, output[-3000:]
    assert ("fairseq-shard-plugin: error: rank 0: another rank's process ended while this "
            "one waited for it in a collective (gloo: connection closed)") in output
    assert "Traceback" not in output, output[-3000:]


def test_a_failed_copy_names_the_newer_checkpoint_written_whole(
    corpus: Path, tmp_path: Path
) -> None:
    """The disk fills once update 6's checkpoint_1_6.pt is written: fairseq's copy of it to
    checkpoint_best.pt fails. The line sent the user back to checkpoint_last.pt (update 3)
    without a word of the whole update-6 file."""
    command = [sys.executable, str(FULL_DISK_HELPER),
               *training_args(corpus, tmp_path, 6), *TINY, "--task", "sharded_translation",
               "--save-interval-updates", "3", "--user-dir", str(PLUGIN_DIR),
               "--ddp-backend", "fully_sharded"]
    env = dict(os.environ, FULL_AFTER_UPDATE="6", FULL_AT="copies",
               FILE_LIMIT=str(512 * 1024), OMP_NUM_THREADS="1")
    returncode, output = start_ranks(command, 2, env, timeout=120)
    assert returncode == 1, output[-3000:]
    errors = {line for line in output.splitlines()
              if line.startswith("fairseq-shard-plugin: error: could not write ")}
    assert len(errors) == 1, output[-3000:]
    assert ("; checkpoint_1_6.pt was written whole before it: to resume from its update "
            "rather than checkpoint_last.pt's, copy it over checkpoint_last.pt first") in \
        errors.pop()
    assert saved_update(tmp_path / "checkpoint_1_6.pt") == 6
    assert saved_update(tmp_path / "checkpoint_last.pt") == 3


def test_the_logged_size_of_a_sharded_checkpoint_is_what_is_written(crashes: dict) -> None:
    """A tiny model's sharded checkpoint is mostly DCP's bytes per chunk (it was announced
    at less than half of what was written)."""
    line = next(line for line in crashes["after_save"].output.splitlines()
                if "checkpoints of this run: about " in line)
    assert "(model and optimizer state, --checkpoint-format sharded)" in line
    value, unit = re.search(r"about ([0-9.]+) (KiB|MiB) each", line).groups()
    announced = float(value) * {"KiB": 2**10, "MiB": 2**20}[unit]
    save_dir = crashes["save_dir"]
    index_file = save_dir / "checkpoint_1_10.pt"
    shards = shard_directory(index_file, torch.load(index_file, weights_only=True))
    written = index_file.stat().st_size + sum(p.stat().st_size for p in shards.iterdir())
    assert abs(announced - written) / written < 0.15, (announced, written)


def test_a_failed_first_save_does_not_promise_a_resume(tmp_path: Path) -> None:
    from fairseq_shard_plugin.checkpoint.errors import save_failure

    line = str(save_failure(WriteError("could not write x"), str(tmp_path)))
    assert line.endswith("run the same command again: no checkpoint was saved yet, so it "
                         "starts afresh")
    # a first save whose copy to checkpoint_last.pt failed after checkpoint_1_10.pt was
    # written: no "no checkpoint was saved yet" beside "written whole" (T2 #6)
    copied = WriteError("could not write checkpoint_last.pt; checkpoint_1_10.pt was written "
                        "whole before it, and no checkpoint_last.pt yet: to resume from "
                        "checkpoint_1_10.pt, copy it to checkpoint_last.pt first")
    line = str(save_failure(copied, str(tmp_path)))
    assert line.endswith("copy it to checkpoint_last.pt first. Fix that and run the same "
                         "command again") and "saved yet" not in line
    (tmp_path / "checkpoint_last.pt").write_bytes(b"")
    assert "it resumes from checkpoint_last.pt" in str(save_failure(WriteError("x"),
                                                                    str(tmp_path)))


def test_a_failed_write_of_a_new_file_does_not_call_it_unchanged(tmp_path: Path) -> None:
    """A checkpoint_best.pt that never existed was "unchanged" (T2 #6)."""
    def fail(out: BinaryIO) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(WriteError, match="no checkpoint_best.pt was written$"):
        write_atomically(tmp_path / "checkpoint_best.pt", fail)


@pytest.mark.parametrize("cause, advice", [
    ("No space left on device (ENOSPC)", "Free space in {save_dir} and run"),
    ("Disk quota exceeded (EDQUOT)", "Free space in {save_dir} and run"),
    ("Not a directory (ENOTDIR)", "Fix that and run"),  # said "Free space" too
    ("File too large (EFBIG)", "A checkpoint file outgrew a file size limit"),  # "Free space"
    ("File too large (EFBIG)", "or train on more ranks (a smaller shard file each)"),
    ("Permission denied (EACCES)", "Fix that and run")])
def test_a_failed_save_asks_for_space_only_when_space_ran_out(
    tmp_path: Path, cause: str, advice: str
) -> None:
    from fairseq_shard_plugin.checkpoint.errors import save_failure

    error = WriteError(f"could not write the shards of update 1 to "
                       f"{tmp_path}/checkpoint_shards/u1: {cause}")
    line = str(save_failure(error, str(tmp_path)))
    assert f"{cause}. {advice.format(save_dir=tmp_path)}" in line or (
        advice.startswith("or ") and advice in line)
    assert "--checkpoint-format sharded" not in line  # the format of these shards already
    assert "the same command again" in line and ("Free space" in line) == ("SPC" in cause
                                                                          or "QUOT" in cause)


def test_a_save_dir_too_small_for_a_save_is_warned_about(tmp_path: Path) -> None:
    mib = 2**20
    not_yet_created = tmp_path / "runs" / "save"  # fairseq creates it at the first save
    line, warning = space_report(str(not_yet_created), mib, "sharded")
    assert not warning and line.endswith(f"free in {not_yet_created}")
    line, warning = space_report("/ckpt", 100 * mib, "full", free_bytes=250 * mib)
    assert warning and line.startswith(
        "checkpoints of this run: about 100.00 MiB each (fp32 model and optimizer state, "
        "--checkpoint-format full); 250.00 MiB free in /ckpt, but a save writes up to "
        "300.00 MiB")
    assert "--checkpoint-format sharded writes it once" in line
    assert not space_report("/ckpt", 100 * mib, "sharded", free_bytes=250 * mib)[1]


@pytest.mark.parametrize("checkpoint_format, one_save, two_saves", [
    ("sharded", 100, 200), ("full", 300, 500)])
def test_room_for_one_save_only_is_warned_about(checkpoint_format: str, one_save: int,
                                                two_saves: int) -> None:
    """The second save needs room beside the first (runH #5: a 5 MiB disk took one 3.2 MiB
    sharded save, and the next one failed hours later)."""
    mib = 2**20
    line, warning = space_report("/ckpt", 100 * mib, checkpoint_format,
                                 free_bytes=(two_saves - 1) * mib)
    assert warning and "room for one save, but the next one adds up to" in line
    assert line.endswith("will fail; free space or pass another --save-dir")
    assert "it will fail" not in line  # the first save fits
    assert not space_report("/ckpt", 100 * mib, checkpoint_format,
                            free_bytes=two_saves * mib)[1]
    assert "room for one save" not in space_report(
        "/ckpt", 100 * mib, checkpoint_format, free_bytes=(one_save - 1) * mib)[0]


def test_the_space_check_counts_only_the_files_fairseq_keeps() -> None:
    """--no-epoch-checkpoints keeps no file per save: two saves fitted a 10 MiB save dir
    that the check said would fail (attackB #4)."""
    from types import SimpleNamespace

    from fairseq_shard_plugin.checkpoint.space import saves_in_copies

    def cfg(**flags: object) -> SimpleNamespace:
        return SimpleNamespace(**{"no_epoch_checkpoints": False, "save_interval_updates": 0,
                                  "no_last_checkpoints": False, **flags})

    assert saves_in_copies("full", cfg()) == (3, 2)
    assert saves_in_copies("full", cfg(no_epoch_checkpoints=True)) == (2, 1)
    assert saves_in_copies("full", cfg(no_epoch_checkpoints=True,
                                       save_interval_updates=10)) == (3, 2)
    assert saves_in_copies("full", cfg(no_last_checkpoints=True)) == (2, 2)
    assert saves_in_copies("sharded", cfg(no_epoch_checkpoints=True)) == (1, 1)
    mib = 2**20
    assert not space_report("/ckpt", int(2.36 * mib), "full", free_bytes=10 * mib,
                            checkpoint_cfg=cfg(no_epoch_checkpoints=True))[1]


# ------------------------------------------------------------ consolidated export


def generate_command(corpus: Path, checkpoint: Path) -> list[str]:
    return [tool("fairseq-generate"), str(corpus), "--path", str(checkpoint),
            "--user-dir", str(PLUGIN_DIR), "--cpu", "--beam", "2", "--max-tokens", "1000",
            "--max-len-b", "20"]


def hypotheses(generated: subprocess.CompletedProcess) -> list[str]:
    """The hypotheses a finished ``fairseq-generate`` printed for the whole test set."""
    assert generated.returncode == 0, generated.stderr[-3000:]
    found = re.search(r"Translated (\d+) sentences", generated.stderr + generated.stdout)
    lines = [line for line in generated.stdout.splitlines() if line.startswith("H-")]
    assert found and len(lines) == int(found.group(1)) > 0
    return lines


def translations(corpus: Path, checkpoint: Path) -> list[str]:
    """Hypotheses of ``fairseq-generate --path checkpoint`` on the test set."""
    return hypotheses(run_command(generate_command(corpus, checkpoint)))


def test_the_export_is_the_final_model_when_fairseqs_save_interval_skips_the_last_epoch(
    corpus: Path, tmp_path: Path
) -> None:
    """One epoch with --save-interval 2: fairseq saves nothing at its end, and the export
    took an older checkpoint_last.pt (or none); the final model is saved for it."""
    run = run_training(training_args(corpus, tmp_path, 0, max_tokens=1024) + TINY + [
        "--task", "sharded_translation", "--max-epoch", "1", "--save-interval", "2",
        "--export-consolidated", str(tmp_path / "model.pt")], nproc=2, plugin=True)
    last = int(run.series("train_inner", "num_updates")[-1])
    assert f"saving the final model (update {last}) for --export-consolidated" in run.output
    assert saved_update(tmp_path / "checkpoint_last.pt") == last
    exported = torch.load(tmp_path / "model.pt", weights_only=True)["model"]
    final = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)["model"]
    assert equal_models(exported, final)


def test_export_at_end_of_training_is_a_standard_inference_checkpoint(
    corpus: Path, uninterrupted: tuple[RunResult, Path]
) -> None:
    _, save_dir = uninterrupted
    export_path = save_dir / "export" / "model.pt"
    exported = torch.load(export_path, weights_only=True)
    final = torch.load(save_dir / "checkpoint_last.pt", weights_only=True)
    assert "last_optimizer_state" not in exported
    assert final["optimizer_history"][-1]["num_updates"] == UPDATES
    for name, tensor in exported["model"].items():  # the gathered full fp32 weights
        assert type(tensor) is torch.Tensor and tensor.dtype == torch.float32, name
    assert equal_models(exported["model"], final["model"])
    assert export_path.stat().st_size < 0.6 * (save_dir / "checkpoint_last.pt").stat().st_size
    tied = [exported["model"][name] for name in TIED]
    assert len({tensor.untyped_storage().data_ptr() for tensor in tied}) == 1  # stored once
    translations(corpus, export_path)


def test_the_same_command_after_the_end_trains_nothing_and_changes_nothing(
    corpus: Path, uninterrupted: tuple[RunResult, Path]
) -> None:
    """A requeued job that had finished: fairseq checks --max-update only after an update,
    so it trained update 41 and overwrote checkpoint_last.pt and the export with it."""
    _, save_dir = uninterrupted
    files = {p: p.read_bytes() for p in (save_dir / "checkpoint_last.pt",
                                         save_dir / "export" / "model.pt")}
    again = run_training(args(corpus, save_dir, "--export-consolidated",
                              str(save_dir / "export" / "model.pt")), nproc=2, plugin=True)
    assert again.logs["train_inner"] == [], again.output[-2000:]
    assert (f"the checkpoint resumed from is at update {UPDATES}, --max-update {UPDATES}: "
            "nothing left to train") in again.output
    assert all(path.read_bytes() == content for path, content in files.items())
    # under torchrun too, exit status 0: a rank aborted at exit ("terminate called without
    # an active exception", -6) where fairseq's data thread had started (--num-workers 0)
    command = [tool("torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), tool("fairseq-train"),
               *args(corpus, save_dir), "--user-dir", str(PLUGIN_DIR), "--ddp-backend",
               "fully_sharded"]
    completed = subprocess.run(command, env=dict(os.environ, OMP_NUM_THREADS="1"),
                               capture_output=True, text=True, timeout=300, cwd=REPO)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "nothing left to train" in completed.stdout + completed.stderr
    assert all(path.read_bytes() == content for path, content in files.items())


def test_stock_fairseq_without_the_plugin_reads_the_export(
    corpus: Path, uninterrupted: tuple[RunResult, Path]
) -> None:
    """Users hand exports to stock tools: stock fairseq-generate, in a process that never
    imports the plugin (no --user-dir), on torch's default weights_only loading, translates
    the export exactly as fairseq-generate with the plugin does. torch alone also reads
    the training checkpoint (its config in plain containers; it names the plugin's task)."""
    export_path = uninterrupted[1] / "export" / "model.pt"
    last = uninterrupted[1] / "checkpoint_last.pt"
    stock = [part for part in generate_command(corpus, export_path)
             if part not in ("--user-dir", str(PLUGIN_DIR))]
    probe = (f"import sys, torch; state = torch.load({str(export_path)!r}); "
             "print(state['cfg']['task']['_name'], state['cfg']['model']['_name']); "
             f"last = torch.load({str(last)!r}); "
             "print(last['cfg']['task']['_name'], type(last['cfg']['model']).__name__); "
             "assert 'fairseq_shard_plugin' not in sys.modules")
    finished = run_concurrently({"stock": stock,
                                 "plugin": generate_command(corpus, export_path),
                                 "load": [sys.executable, "-c", probe]})
    assert finished["load"].returncode == 0, finished["load"].stderr[-2000:]
    assert finished["load"].stdout.split() == ["translation", "transformer",
                                               "sharded_translation", "dict"]
    assert "fairseq_shard_plugin" not in finished["stock"].stderr
    assert hypotheses(finished["stock"]) == hypotheses(finished["plugin"])


def test_consolidate_command_writes_16_bit_weights_that_from_pretrained_loads(
    corpus: Path, uninterrupted: tuple[RunResult, Path], tmp_path: Path
) -> None:
    _, save_dir = uninterrupted
    out = tmp_path / "model16.pt"
    cli_consolidate.main([str(save_dir), str(out), "--fp16"])  # fairseq-shard-consolidate
    exported = torch.load(out, weights_only=True)
    final = torch.load(save_dir / "checkpoint_last.pt", weights_only=True)
    for name, tensor in exported["model"].items():
        assert tensor.dtype == torch.float16, name
        assert torch.equal(tensor, final["model"][name].half()), name

    from fairseq.models.transformer import TransformerModel

    from fairseq_shard_plugin.tasks import register

    # the checkpoint names the plugin's task: registered, as activate() (or --user-dir)
    # does, here without installing the training hooks into this test process
    register()
    hub = TransformerModel.from_pretrained(str(tmp_path), checkpoint_file=out.name,
                                           data_name_or_path=str(corpus))
    embedding = hub.models[0].encoder.embed_tokens.weight
    assert torch.equal(embedding, final["model"]["encoder.embed_tokens.weight"].half().float())
    source = (corpus.parent / "raw" / "test.src").read_text().splitlines()[0]
    assert hub.translate(source, beam=2).split()


def test_consolidate_averages_checkpoints_of_either_format_as_fairseqs_script(
    corpus: Path, uninterrupted: tuple[RunResult, Path], crashes: dict, tmp_path: Path
) -> None:
    """NLLB averages its last checkpoints; fairseq's scripts/average_checkpoints.py cannot
    read a sharded index. The mean of the update-20 and update-30 weights, from the full
    checkpoints of the uninterrupted run and the sharded ones of the crashed-and-resumed
    run (the same weights): fairseq's arithmetic (sum in the given order, then divide),
    the tied weight once, and stock fairseq-generate without the plugin translates it."""
    full_dir, sharded_dir = uninterrupted[1], crashes["save_dir"]
    names = ["checkpoint_1_20.pt", "checkpoint_1_30.pt"]
    averaged = {}
    for label, folder in (("full", full_dir), ("sharded", sharded_dir)):
        averaged[label] = tmp_path / f"{label}.pt"
        cli_consolidate.main(["--average", *(str(folder / name) for name in names),
                              str(averaged[label])])
    states = [torch.load(full_dir / name, weights_only=True)["model"] for name in names]
    expected = {key: (states[0][key] + states[1][key]).div_(2) for key in states[0]}
    for label, path in averaged.items():
        exported = torch.load(path, weights_only=True)
        assert "last_optimizer_state" not in exported, label
        assert equal_models(exported["model"], expected), label
        storages = {exported["model"][name].untyped_storage().data_ptr() for name in TIED}
        assert len(storages) == 1, label
    stock = [part for part in generate_command(corpus, averaged["sharded"])
             if part not in ("--user-dir", str(PLUGIN_DIR))]
    finished = run_concurrently({"stock": stock})["stock"]
    assert finished.returncode == 0 and hypotheses(finished), finished.stderr[-2000:]


def test_consolidate_refuses_to_average_other_models_or_several_without_the_flag(
    uninterrupted: tuple[RunResult, Path], tmp_path: Path
) -> None:
    save_dir = uninterrupted[1]
    other = tmp_path / "other.pt"
    state = torch.load(save_dir / "checkpoint_1_20.pt", weights_only=True)
    del state["model"]["decoder.layers.0.fc1.bias"]
    torch.save(state, other)
    out = tmp_path / "model.pt"
    with pytest.raises(SystemExit) as refused:
        cli_consolidate.main(["--average", str(save_dir / "checkpoint_1_30.pt"), str(other),
                              str(out)])
    assert str(refused.value) == (
        f"fairseq-shard-consolidate: error: cannot average {save_dir / 'checkpoint_1_30.pt'} "
        f"and {other}: decoder.layers.0.fc1.bias is in {save_dir / 'checkpoint_1_30.pt'} but "
        f"not in {other} (another model)")
    with pytest.raises(SystemExit, match="2 checkpoints given: add --average to export the "
                       "mean of their weights"):
        cli_consolidate.main([str(save_dir / "checkpoint_1_30.pt"), str(other), str(out)])
    assert not out.exists() and not list(tmp_path.glob(".model.pt*"))
    # OUT forgotten: the last export given would be replaced by the average (lifeT #2)
    exports = [tmp_path / "a.pt", tmp_path / "b.pt"]
    for export in exports:
        cli_consolidate.main([str(save_dir / "checkpoint_1_30.pt"), str(export)])
    before = exports[1].read_bytes()
    with pytest.raises(SystemExit, match="it exists, and the last path given is the output"):
        cli_consolidate.main(["--average", str(save_dir / "checkpoint_1_30.pt"),
                              *(str(export) for export in exports)])
    assert exports[1].read_bytes() == before


@pytest.mark.parametrize(
    ("damage", "named"),
    [("truncated", "checkpoint_last.pt: truncated checkpoint ("),
     ("corrupted", "checkpoint_last.pt: corrupted checkpoint: archive/data/")],
)
def test_consolidate_refuses_a_damaged_checkpoint_in_one_line(
    uninterrupted: tuple[RunResult, Path], tmp_path: Path, damage: str, named: str
) -> None:
    whole = (uninterrupted[1] / "checkpoint_last.pt").read_bytes()
    damaged = tmp_path / "checkpoint_last.pt"
    if damage == "truncated":
        damaged.write_bytes(whole[: len(whole) // 3])
    else:
        damaged.write_bytes(whole)
        flip_middle_byte(damaged)
    with pytest.raises(SystemExit) as stopped:
        cli_consolidate.main([str(tmp_path), str(tmp_path / "out.pt")])
    message = str(stopped.value.code)
    assert "\n" not in message and message.startswith("fairseq-shard-consolidate: error: ")
    assert named in message and ("truncated" in message or "CRC-32" in message)
    # what to do, as every other line for a damaged file says (T4 #6, session 25)
    assert message.endswith("export an intact checkpoint instead (fairseq-shard-verify "
                            "SAVE_DIR lists them)"), message
    assert not (tmp_path / "out.pt").exists()


def test_consolidate_names_a_destination_it_cannot_write(
    uninterrupted: tuple[RunResult, Path]
) -> None:
    save_dir = uninterrupted[1]
    inside_a_file = save_dir / "checkpoint_last.pt" / "model.pt"
    with pytest.raises(SystemExit) as stopped:
        cli_consolidate.main([str(save_dir), str(inside_a_file)])
    message = str(stopped.value.code)
    assert message == (f"fairseq-shard-consolidate: error: could not write {inside_a_file}: "
                       f"{save_dir / 'checkpoint_last.pt'} is a file, not a directory; give "
                       "another path or move that file")


def test_consolidate_names_a_pickled_type_it_will_not_load(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint_last.pt"
    torch.save({"model": {}, "cfg": None, "note": PurePosixPath("x")}, checkpoint)
    with pytest.raises(SystemExit) as stopped:
        cli_consolidate.main([str(checkpoint), str(tmp_path / "out.pt")])
    message = str(stopped.value.code)
    assert "\n" not in message
    assert f"{checkpoint}: holds a pickled pathlib.PurePosixPath, which the plugin " in message
    assert not (tmp_path / "out.pt").exists()


def test_verify_tells_damaged_checkpoints_from_intact_ones(
    uninterrupted: tuple[RunResult, Path], crashes: dict, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """fairseq-shard-verify on copies of a full and a sharded save dir, a few files damaged."""
    full, sharded = tmp_path / "full", tmp_path / "sharded"
    shutil.copytree(uninterrupted[1], full)
    shutil.copytree(crashes["save_dir"], sharded)
    flip_middle_byte(full / "checkpoint_1_20.pt")
    whole = (full / "checkpoint_1_30.pt").read_bytes()
    (full / "checkpoint_1_30.pt").write_bytes(whole[: len(whole) // 3])
    index = torch.load(sharded / "checkpoint_1_30.pt", weights_only=True)
    flip_middle_byte(next(shard_directory(sharded / "checkpoint_1_30.pt", index).glob("*.distcp")))
    with pytest.raises(SystemExit) as stopped:
        cli_verify.main([str(full), str(sharded)])
    assert stopped.value.code == 1
    out = capsys.readouterr().out
    assert f"{full / 'checkpoint_1_20.pt'}: corrupted checkpoint: archive/" in out
    assert f"{full / 'checkpoint_1_30.pt'}: truncated checkpoint (" in out
    assert f"{full / 'checkpoint_1_40.pt'}: ok (full, update 40, resumes in epoch 1)" in out
    assert f"{sharded / 'checkpoint_1_30.pt'}: corrupted checkpoint: " in out
    # checkpoint_best.pt is an index of the same update-30 shards: damaged with them
    assert f"{sharded / 'checkpoint_best.pt'}: corrupted checkpoint: " in out
    assert f"{sharded / 'checkpoint_last.pt'}: ok (sharded, update 20, resumes in epoch 1)" in out
    assert out.strip().splitlines()[-1] == "4 of 11 checkpoints cannot be resumed from", out
    # the newest intact one skips the damaged update-30 shards
    cli_verify.main(["--newest", str(sharded)])
    assert capsys.readouterr().out == f"{sharded / 'checkpoint_last.pt'}\n"


# ------------------------------------------------- --checkpoint-format sharded (DCP shards)


def test_sharded_save_writes_each_ranks_shards_and_small_indexes(
    crashes: dict, uninterrupted: tuple[RunResult, Path], tmp_path: Path
) -> None:
    save_dir, full_dir = crashes["save_dir"], uninterrupted[1]
    first = crashes["files_after_first_crash"]
    assert sorted(first) == ["checkpoint_1_10.pt", "checkpoint_1_20.pt", "checkpoint_best.pt",
                             "checkpoint_last.pt"]
    assert [name.split("-")[0] for name in crashes["shards_after_first_crash"]] == ["u10", "u20"]
    index = torch.load(save_dir / "checkpoint_1_20.pt", weights_only=True)
    shards = save_dir / index["sharded_checkpoint"]["dir"]
    assert sorted(p.name for p in shards.iterdir()) == [".fairseq-shard-plugin", ".metadata",
                                                       "__0_0.distcp", "__1_0.distcp"]
    assert index["extra_state"]["train_iterator"]["iterations_in_epoch"] == 20
    # the tied embeddings and output projection are written once; the other names refer to it
    assert {str(index["model"][name]) for name in TIED} == {
        "{'__shard__': 'model/encoder.embed_tokens.weight'}"}
    full_size = (full_dir / "checkpoint_1_20.pt").stat().st_size
    assert len(first["checkpoint_1_20.pt"]) < 0.1 * full_size
    # the shards, gathered by the consolidate command, are bit for bit the full checkpoint
    # of the same update (written by the uninterrupted run in the full format)
    gathered = consolidate.read_full_state(save_dir / "checkpoint_1_20.pt")
    full = torch.load(full_dir / "checkpoint_1_20.pt", weights_only=True)
    assert equal_models(gathered["model"], full["model"])
    for index, moments in full["last_optimizer_state"]["state"].items():
        saved = gathered["last_optimizer_state"]["state"][index]
        assert saved["step"] == moments["step"]
        assert torch.equal(saved["exp_avg"], moments["exp_avg"])
        assert torch.equal(saved["exp_avg_sq"], moments["exp_avg_sq"])
    out = consolidate.export_consolidated(save_dir / "checkpoint_1_20.pt", tmp_path / "m.pt")
    assert equal_models(torch.load(out, weights_only=True)["model"], full["model"])


def test_fairseq_generate_reads_a_sharded_checkpoint_directly(
    corpus: Path, crashes: dict, uninterrupted: tuple[RunResult, Path], tmp_path: Path
) -> None:
    """With the plugin as --user-dir, fairseq's own loader gathers the shards (hook 6): the
    index of update 20 translates exactly as the full checkpoint of the same update. An
    index copied without its shards is one line, with advice for generation, not a resume."""
    copied = tmp_path / "best.pt"
    shutil.copyfile(crashes["save_dir"] / "checkpoint_1_20.pt", copied)
    generated = run_concurrently({
        "sharded": generate_command(corpus, crashes["save_dir"] / "checkpoint_1_20.pt"),
        "full": generate_command(corpus, uninterrupted[1] / "checkpoint_1_20.pt"),
        "copied": generate_command(corpus, copied)})
    assert hypotheses(generated["sharded"]) == hypotheses(generated["full"])
    line = generated["copied"].stderr.strip().splitlines()[-1]
    assert line.startswith(f"fairseq-shard-plugin: error: {copied}: its shard directory "), line
    assert line.endswith("use an intact checkpoint (fairseq-shard-verify FILE or SAVE_DIR "
                         "checks them)") and "--restore-file" not in line, line


def _plugin_shards(shards: Path, *names: str, save_dir: Path | None = None) -> None:
    """Shard directories as the plugin writes them for ``save_dir`` (by default the
    directory that holds ``shards``)."""
    for name in names:
        mark_as_shard_directory(shards / name, save_dir or shards.parent)
        (shards / name / ".metadata").write_bytes(b"x")


def _indexes(save_dir: Path, **targets: str) -> None:
    for name, target in targets.items():
        torch.save({"sharded_checkpoint": {"dir": f"{SHARDS_DIR}/{target}"}},
                   save_dir / f"{name}.pt")


def test_shards_that_no_checkpoint_names_are_removed(tmp_path: Path) -> None:
    shards = tmp_path / SHARDS_DIR
    _plugin_shards(shards, "u5-z", "u10-a", "u20-b", "u30-c")
    _indexes(tmp_path, checkpoint_1_20="u20-b", checkpoint_last="u30-c")
    torch.save({"model": {}}, tmp_path / "checkpoint_best.pt")  # a full checkpoint
    # a user's copy of an older index keeps its shards too
    torch.save({"sharded_checkpoint": {"dir": f"{SHARDS_DIR}/u5-z"}},
               tmp_path / "checkpoint_last.pt.bak")
    (tmp_path / "train.log").write_text("not a checkpoint")  # not read
    removed = remove_unreferenced_shards(tmp_path, lambda p: torch.load(p, weights_only=True))
    assert removed == [shards / "u10-a"]
    assert sorted(p.name for p in shards.iterdir()) == ["u20-b", "u30-c", "u5-z"]


def test_cleanup_through_a_symlinked_shards_dir_deletes_only_the_plugins_directories(
    tmp_path: Path,
) -> None:
    """checkpoint_shards/ as a symlink to a scratch disk that holds other things: only the
    plugin's own unreferenced directories go; nothing else there, and nothing a symlink
    inside it points to, is touched."""
    scratch, elsewhere = tmp_path / "scratch", tmp_path / "elsewhere"
    (scratch / "photos").mkdir(parents=True)
    (scratch / "photos" / "holiday.jpg").write_bytes(b"jpeg")
    (scratch / "u5-abc").mkdir()  # named like ours, not marked as ours
    (scratch / "u5-abc" / "notes.txt").write_text("mine")
    save_dir = tmp_path / "save"
    mark_as_shard_directory(scratch / "u7-aaa", save_dir)  # marked for another name, renamed
    (scratch / "u7-aaa").rename(scratch / "u6-def")
    assert (scratch / "u6-def" / MARKER).is_file()
    # marked, but reached only through a symlink
    _plugin_shards(elsewhere, "u8-bbb", save_dir=save_dir)
    (scratch / "u8-bbb").symlink_to(elsewhere / "u8-bbb")
    save_dir.mkdir()
    (save_dir / SHARDS_DIR).symlink_to(scratch)
    _plugin_shards(save_dir / SHARDS_DIR, "u10-a", "u20-b")
    _indexes(save_dir, checkpoint_last="u20-b")
    removed = remove_unreferenced_shards(save_dir, lambda p: torch.load(p, weights_only=True))
    assert removed == [save_dir / SHARDS_DIR / "u10-a"]
    assert sorted(p.name for p in scratch.iterdir()) == ["photos", "u20-b", "u5-abc", "u6-def",
                                                         "u8-bbb"]
    assert (scratch / "photos" / "holiday.jpg").read_bytes() == b"jpeg"
    assert (scratch / "u5-abc" / "notes.txt").read_text() == "mine"
    assert (elsewhere / "u8-bbb" / ".metadata").exists()


def test_save_dirs_sharing_one_scratch_directory_delete_only_their_own_shards(
    tmp_path: Path,
) -> None:
    """Two runs link checkpoint_shards/ to the same scratch disk: each one's cleanup
    leaves the other's shard directories alone, referenced or not."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    first, second = tmp_path / "first", tmp_path / "second"
    for save_dir in (first, second):
        save_dir.mkdir()
        (save_dir / SHARDS_DIR).symlink_to(scratch)
    _plugin_shards(first / SHARDS_DIR, "u1-a", "u2-b", save_dir=first)
    _indexes(first, checkpoint_last="u2-b")
    _plugin_shards(second / SHARDS_DIR, "u1-c", save_dir=second)
    _indexes(second, checkpoint_last="u1-c")
    # through another path to the same save dir: still its own
    (tmp_path / "first_link").symlink_to(first)
    assert is_plugin_shard_directory(scratch / "u1-a", tmp_path / "first_link")
    removed = remove_unreferenced_shards(second, lambda p: torch.load(p, weights_only=True))
    assert removed == [] and sorted(p.name for p in scratch.iterdir()) == ["u1-a", "u1-c",
                                                                        "u2-b"]
    removed = remove_unreferenced_shards(first, lambda p: torch.load(p, weights_only=True))
    assert removed == [first / SHARDS_DIR / "u1-a"]
    assert sorted(p.name for p in scratch.iterdir()) == ["u1-c", "u2-b"]


def test_a_shards_directory_that_cannot_be_created_is_one_write_error(tmp_path: Path) -> None:
    """checkpoint_shards is a file (or read-only, or a dangling link): one WriteError
    naming it, before any shard is written; nothing else changes."""
    (tmp_path / SHARDS_DIR).write_text("not a directory")
    with pytest.raises(WriteError, match=f"could not create the shard directory {tmp_path}/"
                       f"{SHARDS_DIR}/u3-[0-9a-f]+ for update 3: .*; the checkpoints saved "
                       "before are unchanged"):
        save_sharded({"model": {"w": torch.ones(2)}}, tmp_path, 3)
    assert (tmp_path / SHARDS_DIR).read_text() == "not a directory"


def test_markers_of_earlier_releases_count_only_in_a_real_shards_directory(
    tmp_path: Path,
) -> None:
    """Markers written before the save dir was recorded in them: owned by the save dir
    whose checkpoint_shards/ holds them, unless that is a link (then shared, perhaps)."""
    legacy = f"{MARKER_HEADER} u1-a\n"
    own, linked, scratch = tmp_path / "own", tmp_path / "linked", tmp_path / "scratch"
    for shards in (own / SHARDS_DIR, scratch):
        (shards / "u1-a").mkdir(parents=True)
        (shards / "u1-a" / MARKER).write_text(legacy)
    linked.mkdir()
    (linked / SHARDS_DIR).symlink_to(scratch)
    assert is_plugin_shard_directory(own / SHARDS_DIR / "u1-a", own)
    assert not is_plugin_shard_directory(linked / SHARDS_DIR / "u1-a", linked)


def test_an_unreadable_checkpoint_keeps_every_shard_directory_and_says_which(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    shards = tmp_path / SHARDS_DIR
    _plugin_shards(shards, "u10-a", "u20-b")
    _indexes(tmp_path, checkpoint_last="u20-b")
    (tmp_path / "checkpoint_1_10.pt").write_bytes(b"truncated")
    with caplog.at_level("WARNING"):
        removed = remove_unreferenced_shards(tmp_path, read_checkpoint)
    assert removed == []
    assert sorted(p.name for p in shards.iterdir()) == ["u10-a", "u20-b"]
    assert f"{tmp_path / 'checkpoint_1_10.pt'} could not be read" in caplog.text
    assert "not a PyTorch checkpoint" in caplog.text


@pytest.fixture(scope="module")
def stock_checkpoint(
    corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[RunResult, Path]:
    """A checkpoint written by stock fairseq (no plugin, legacy_ddp, 2 ranks, 20 updates)."""
    save_dir = tmp_path_factory.mktemp("stock")
    run = run_training(training_args(corpus, save_dir, 20, max_tokens=MAX_TOKENS) + TINY
                       + ["--task", "translation"], nproc=2, plugin=False)
    return run, save_dir / "checkpoint_last.pt"


def test_fine_tuning_from_a_stock_fairseq_checkpoint_matches_stock_fine_tuning(
    corpus: Path, stock_checkpoint: tuple[RunResult, Path], tmp_path: Path
) -> None:
    """The reverse of the export: a standard checkpoint (a released model) starts sharded
    training with fairseq's usual fine-tuning flags, and trains as stock fairseq would."""
    pretrained, checkpoint = stock_checkpoint
    fine_tune = ["--restore-file", str(checkpoint), "--reset-optimizer", "--reset-dataloader",
                 "--reset-lr-scheduler", "--reset-meters", "--no-save"]
    # The reference is stock fairseq's data parallel training. fairseq 0.12 cannot read its
    # own checkpoints under torch >= 2.6's weights_only loading: --user-dir adds the
    # plugin's allow-list, and has every rank read the file itself (rank 0's broadcast
    # re-pickles the OmegaConf config, which the other ranks refused to unpickle).
    runs = {sharded: run_training(
        training_args(corpus, tmp_path / str(sharded), 5, max_tokens=MAX_TOKENS) + TINY
        + (["--task", "sharded_translation"] if sharded else
           ["--task", "translation", "--user-dir", str(PLUGIN_DIR)]) + fine_tune,
        nproc=2, plugin=sharded) for sharded in (False, True)}
    assert "Loaded checkpoint" in runs[True].output
    losses, reference = (runs[p].series("train_inner", "loss") for p in (True, False))
    assert len(losses) == 5 and losses == pytest.approx(reference, rel=1e-4)
    assert losses[0] < pretrained.series("train_inner", "loss")[0] - 0.5  # trained weights


def test_checkpoints_reload_exactly_from_2_to_4_to_1_ranks_and_bad_ones_change_nothing(
    corpus: Path, crashes: dict, uninterrupted: tuple[RunResult, Path],
    stock_checkpoint: tuple[RunResult, Path], tmp_path: Path,
) -> None:
    two_ranks = str(crashes["save_dir"] / "checkpoint_1_20.pt")
    full = str(uninterrupted[1] / "checkpoint_1_20.pt")
    four_ranks = tmp_path / "four" / "checkpoint_last.pt"
    on_four = reshard(4, corpus, four_ranks.parent,
                      {"exact": [str(stock_checkpoint[1]), full, two_ranks],
                       "write": str(four_ranks)})
    assert len(list((four_ranks.parent / SHARDS_DIR).glob("*/__*.distcp"))) == 4

    broken = []
    for damage in ("truncated", "no_metadata", "corrupted"):
        copy = tmp_path / damage
        shutil.copytree(crashes["save_dir"], copy)
        shards = copy / torch.load(copy / "checkpoint_1_20.pt",
                                   weights_only=True)["sharded_checkpoint"]["dir"]
        if damage == "truncated":
            data = (shards / "__1_0.distcp").read_bytes()
            (shards / "__1_0.distcp").write_bytes(data[: len(data) // 2])
        elif damage == "no_metadata":
            (shards / ".metadata").unlink()
        else:
            flip_middle_byte(shards / "__1_0.distcp")
        broken.append(str(copy / "checkpoint_1_20.pt"))
    (tmp_path / "corrupted_full").mkdir()
    broken.append(shutil.copy(full, tmp_path / "corrupted_full"))
    flip_middle_byte(Path(broken[-1]))
    # a failure that is neither a shape nor a name mismatch: a tensor without data
    no_data = torch.load(full, weights_only=True)
    no_data["model"]["decoder.layers.1.fc2.weight"] = torch.empty(
        no_data["model"]["decoder.layers.1.fc2.weight"].shape, device="meta")
    (tmp_path / "no_data").mkdir()
    torch.save(no_data, tmp_path / "no_data" / "checkpoint_1_20.pt")
    broken.append(str(tmp_path / "no_data" / "checkpoint_1_20.pt"))
    other_vocab = tmp_path / "other_vocab"
    shutil.copytree(corpus, other_vocab)
    for dictionary in other_vocab.glob("dict.*.txt"):
        dictionary.write_text(dictionary.read_text() + "unseenword 1\n")
    on_one = reshard(1, corpus, tmp_path / "one", {
        "exact": [str(four_ranks), full], "broken": broken, "other_vocab": str(other_vocab),
        "other_arch": ["--encoder-ffn-embed-dim", "256", "--decoder-ffn-embed-dim", "256"]})

    assert len(on_four["exact"]) == 3 and len(on_one["exact"]) == 2  # one per checkpoint
    for report in on_four["exact"] + on_one["exact"]:
        assert report["model_equal"] and report["optimizer_equal"], report
        assert report["optimizer_tensors"] > 0 and report["num_updates"] == 20, report
    assert len(on_one["broken"]) == 5
    truncated, no_metadata, corrupted_shard, corrupted_full, no_data = on_one["broken"]
    for refusal in (*on_one["broken"], on_one["other_arch"], on_one["other_vocab"]):
        assert refusal["unchanged"] and "\n" not in refusal["error"], refusal
        assert refusal["error"].startswith(refusal["checkpoint"] + ": "), refusal
    assert "__1_0.distcp is truncated" in truncated["error"]
    assert "no readable .metadata" in no_metadata["error"]
    assert re.search(r"corrupted checkpoint: \S+/__1_0.distcp fails its CRC-32 check",
                     corrupted_shard["error"]), corrupted_shard
    assert re.search(r"corrupted checkpoint: archive/data/\d+ fails its CRC-32 check",
                     corrupted_full["error"]), corrupted_full
    # the innermost exception, not fairseq's "please ensure that the architectures match"
    assert no_data["error"].endswith(
        "could not be loaded: NotImplementedError: Cannot copy out of meta tensor; no data!"
    ), no_data
    for other_arch in on_one["other_arch"], on_one["other_arch_full"]:  # not "optimizer"
        assert other_arch["unchanged"] and other_arch["error"] == (
            f"{other_arch['checkpoint']}: does not match the model: encoder.layers.0.fc1."
            "weight has shape [128, 64] in the checkpoint and [256, 64] in the model")
    vocab = re.search(r"embed_tokens.weight has shape \[(\d+), 64\] in the checkpoint and "
                      r"\[(\d+), 64\] in the model$", on_one["other_vocab"]["error"])
    assert vocab and int(vocab.group(2)) == int(vocab.group(1)) + 1, on_one["other_vocab"]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--export-consolidated", "m.pt", "--no-save"], "--export-consolidated"),
        (["--checkpoint-format", "sharded", "--shard-engine", "fairscale"],
         "--checkpoint-format sharded"),
        (["--write-checkpoints-asynchronously"], "--write-checkpoints-asynchronously"),
    ],
)
def test_unworkable_checkpoint_options_are_refused_with_the_flag_named(
    corpus: Path, flags: list[str], named: str
) -> None:
    from fairseq_shard_plugin.training.validation import ShardingConfigError, check_sharded_config

    cfg = sharded_config(corpus, "--task", "sharded_translation", "--user-dir", str(PLUGIN_DIR),
                         "--cpu", *flags)
    with pytest.raises(ShardingConfigError, match=named):
        check_sharded_config(cfg)


def test_the_signal_line_says_how_to_resume_a_run_that_named_its_restore_file() -> None:
    """A fine-tune started with --restore-file FILE --reset-* loads FILE at every launch:
    "the same command resumes from it" sent requeued jobs back to the released model. The
    save dir's own checkpoint_last.pt by path does resume; --reset-* flags alone do not."""
    from types import SimpleNamespace

    from fairseq_shard_plugin.fairseq_integration import _how_to_resume

    def advice(restore: str, **resets: bool) -> str:
        return _how_to_resume(SimpleNamespace(restore_file=restore, save_dir="/ckpt",
                                              checkpoint_suffix="", **resets))

    assert advice("checkpoint_last.pt") == "the same command resumes from it"
    assert advice("/ckpt/checkpoint_last.pt") == "the same command resumes from it"
    assert advice("released.pt", reset_optimizer=True).startswith(
        "resume from it with the same command without --restore-file released.pt and "
        "--reset-optimizer (each launch would start")
    assert advice("checkpoint_last.pt", reset_dataloader=True, reset_meters=True).startswith(
        "resume from it with the same command without --reset-meters --reset-dataloader (")


def test_fairseq_generate_names_a_damaged_or_truncated_checkpoint_in_one_line(
    corpus: Path, tmp_path: Path, sharded_tiny_run: tuple[RunResult, Path]
) -> None:
    """Outside the trainer a changed byte in a tensor translated differently without a word
    (rc 0), and a truncated file ended in torch's traceback: the file's CRC-32s are checked
    as the trainer checks them."""
    source = (sharded_tiny_run[1] / "checkpoint_last.pt").read_bytes()
    damaged, truncated = tmp_path / "damaged.pt", tmp_path / "truncated.pt"
    with zipfile.ZipFile(io.BytesIO(source)) as archive:
        entry = next(info for info in archive.infolist() if "/data/" in info.filename
                     and info.file_size > 1000)
    at = entry.header_offset + 30 + len(entry.filename) + len(entry.extra) + 100
    damaged.write_bytes(source[:at] + bytes([source[at] ^ 0x01]) + source[at + 1:])
    truncated.write_bytes(source[: len(source) // 2])
    generated = run_concurrently({name: generate_command(corpus, path)
                                  for name, path in (("damaged", damaged),
                                                     ("truncated", truncated))})
    for name, said in (("damaged", f"{damaged}: corrupted checkpoint: {entry.filename} fails "
                                   "its CRC-32 check"),
                       ("truncated", f"{truncated}: truncated checkpoint ({len(source) // 2} "
                                     "bytes: its end, the zip directory, is missing)")):
        done = generated[name]
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert done.stderr.strip().splitlines()[-1].startswith(
            f"fairseq-shard-plugin: error: {said}"), done.stderr[-1000:]


@pytest.mark.parametrize("agreed", [False, True], ids=["waiting-for-a-peer", "saving"])
def test_a_later_signal_before_the_ranks_agreed_ends_the_process(agreed: bool) -> None:
    """A rank waiting in a collective for a peer that hangs never reaches the agreement:
    an operator's second SIGTERM was ignored until gloo's timeout (T2 #3). A repeat within
    the patience (srun torchrun delivers two) is recorded only, and once the ranks agreed
    the save goes on whatever comes."""
    script = f"""
import os, signal, sys, time
import torch
from fairseq_shard_plugin.training import signal_stop
signal_stop.PATIENCE_S = 0.5
stop = signal_stop.install((signal.SIGTERM,))
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.1)
os.kill(os.getpid(), signal.SIGTERM)
if {agreed}:
    stop.agreed(torch.device("cpu"))
time.sleep(0.7)
print("alive after the repeat", stop.received, flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print("alive at the end", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert f"alive after the repeat {int(signal.SIGTERM)}" in done.stdout, done.stderr[-2000:]
    if agreed:
        assert done.returncode == 0 and "alive at the end" in done.stdout
    else:
        assert done.returncode == 128 + signal.SIGTERM and "alive at the end" not in done.stdout
        assert ("fairseq-shard-plugin: SIGTERM again, 0.5 s or more after the first, before the "
                "ranks agreed to stop (a peer does not answer?): ending without saving"
                ) in done.stderr


def test_a_later_signal_ends_a_rank_blocked_inside_one_long_call() -> None:
    """A rank waiting inside a collective runs no Python signal handler until the call
    returns (gloo's timeout, 30 minutes, for a hung peer): the second signal was only
    handled once the peer came back (T4 #1). One long torch call stands for the wait."""
    script = """
import os, signal, threading, time
import torch
from fairseq_shard_plugin.training import signal_stop
signal_stop.PATIENCE_S = 0.5
torch.set_num_threads(1)
signal_stop.install((signal.SIGTERM,))

def send():
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.8)
    os.kill(os.getpid(), signal.SIGTERM)

matrix = torch.randn(3000, 3000, dtype=torch.float64)
threading.Thread(target=send, daemon=True).start()
started = time.monotonic()
torch.linalg.svd(matrix)  # seconds in one C call
print(f"the call returned after {time.monotonic() - started:.1f} s", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 128 + signal.SIGTERM, (done.stdout, done.stderr[-2000:])
    assert "the call returned" not in done.stdout
    assert "SIGTERM again, 0.5 s or more after the first" in done.stderr


EXPORT_FAILS_HELPER = REPO / "tests" / "helpers" / "export_fails.py"


def test_an_export_that_fails_on_rank_0_ends_every_rank_with_its_line(
    corpus: Path, tmp_path: Path
) -> None:
    """Rank 0 exports while the others wait for the end: they died in fairseq's last
    barrier, in a gloo traceback, when rank 0's export failed (T2 #5)."""
    target = tmp_path / "export" / "final.pt"
    args = [*training_args(corpus, tmp_path / "save", 4), *TINY, "--task", "sharded_translation",
            "--export-consolidated", str(target), "--user-dir", str(PLUGIN_DIR),
            "--ddp-backend", "fully_sharded"]
    env = dict(os.environ, FILE_LIMIT="4096", OMP_NUM_THREADS="1")
    returncode, output = start_ranks([sys.executable, str(EXPORT_FAILS_HELPER), *args], 2, env,
                                     timeout=300)
    assert returncode == 1, output[-3000:]
    errors = [line for line in output.splitlines()
              if line.startswith("fairseq-shard-plugin: error: ")]
    # rank 1's line (rank 0's own output file is past the helper's limit by then)
    assert len(set(errors)) == 1, output[-3000:]
    assert f"could not write {target}: " in errors[0]
    assert errors[0].endswith("(the training itself finished: once that is fixed, the same "
                              "command exports without training)")
    assert "Traceback" not in output and not target.exists()
