"""One training per save dir, and one save dir for every rank (checkpoint.save_dir_claim).

Found by a tester: two runs in one save dir (sharded format) deleted each other's newest
shards and reported their saves as done; ranks whose relative --save-dir resolved from
different working directories (Hydra's per-rank ``${now:...}`` run directories) split every
sharded save between two directories, rc 0; a save whose index write failed left its
complete shard directory behind, and the resumed run had no room to save.
"""

from __future__ import annotations

import os
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from fairseq_shard_plugin.checkpoint.save_dir_claim import LOCK_NAME, claimed_save_dir
from fairseq_shard_plugin.checkpoint.sharded import MARKER, SHARDS_DIR, mark_as_shard_directory
from fairseq_shard_plugin.checkpoint.verify import check
from launching.harness import (
    PLUGIN_DIR,
    rank_environment,
    run_training,
    start_ranks,
    tool,
    training_args,
)

from tiny_training import SHARDED, TINY

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)


def _plugin_args(args: list[str]) -> list[str]:
    return [*args, "--task", "sharded_translation"]


def _plugin_command(args: list[str]) -> list[str]:
    return [tool("fairseq-train"), *_plugin_args(args), "--user-dir", str(PLUGIN_DIR),
            "--ddp-backend", "fully_sharded"]


def test_a_second_training_in_a_save_dir_in_use_stops_in_one_line_and_writes_nothing(
    corpus: Path, tmp_path: Path
) -> None:
    save_dir = tmp_path / "save"
    args = [*training_args(corpus, save_dir, max_update=2), *TINY, *SHARDED]
    with claimed_save_dir(str(save_dir)):  # as a training that holds it does
        code, output = start_ranks(_plugin_command(args), 2, rank_environment(), timeout=120)
        assert code == 1, output[-3000:]
        errors = [line for line in output.splitlines()
                  if line.startswith("fairseq-shard-plugin: error: ")]
        assert len(errors) == 2 and len(set(errors)) == 1, output[-3000:]  # every rank
        assert errors[0].startswith("fairseq-shard-plugin: error: another training (pid ")
        assert f"is saving its checkpoints into {save_dir}: give this one its own --save-dir" \
            in errors[0]
        assert "Traceback" not in output and "| epoch 001 |" not in output
        assert sorted(path.name for path in save_dir.iterdir()) == [LOCK_NAME]
    run_training(_plugin_args(args), nproc=2, plugin=True)  # once the save dir is free
    assert check(save_dir / "checkpoint_last.pt").resumable
    assert not (save_dir / LOCK_NAME).exists()  # removed at the end


def test_ranks_whose_save_dirs_differ_are_refused_before_training(
    corpus: Path, tmp_path: Path
) -> None:
    """A relative --save-dir from a different working directory on each rank."""
    cwds = [tmp_path / "rank0", tmp_path / "rank1"]
    for cwd in cwds:
        cwd.mkdir()
    args = [*training_args(corpus, Path("save"), max_update=2), *TINY, *SHARDED]
    code, output = start_ranks(_plugin_command(args), 2, rank_environment(), cwd=cwds,
                               timeout=120)
    assert code == 1, output[-3000:]
    errors = [line for line in output.splitlines()
              if line.startswith("fairseq-shard-plugin: error: ")]
    assert errors == [
        f"fairseq-shard-plugin: error: the save dir is {cwds[0] / 'save'} on rank 0 but "
        f"{cwds[1] / 'save'} on rank 1: every rank must save into one directory (a relative "
        "--save-dir resolves from each rank's working directory, which Hydra makes per rank "
        "with hydra.job.chdir and a ${now:...} hydra.run.dir): give an absolute --save-dir "
        "(checkpoint.save_dir)"] * 2, output[-3000:]
    assert not (cwds[1] / "save").exists() and not any((cwds[0] / "save").iterdir())


def test_shard_directories_no_checkpoint_refers_to_are_removed_before_the_first_update(
    corpus: Path, tmp_path: Path
) -> None:
    """What a save that was killed, or whose index could not be written, leaves behind is
    removed before the first update (it took the room the first save needed); a directory
    the plugin did not mark is kept, and so are the shards of an index set aside under
    another name, which the run resumes from (they were removed before it was loaded), and
    nothing is removed by a run that stops before training."""
    save_dir = tmp_path / "save"
    first = _plugin_args([*training_args(corpus, save_dir, max_update=4), *TINY, *SHARDED,
                          "--save-interval-updates", "2"])
    run_training(first, nproc=1, plugin=True)
    (save_dir / "checkpoint_1_2.pt").rename(save_dir / "update2.ckpt")  # set aside
    with zipfile.ZipFile(save_dir / "logs.zip", "w") as logs:  # an archive, but no index:
        logs.writestr("train.log", "loss 9.8\n")  # it stopped every cleanup
    shards = save_dir / SHARDS_DIR
    kept = sorted(shards.iterdir())
    orphan = shards / "u3-18ee78e97eafec63"  # update 3's save, its index never written
    shutil.copytree(kept[0], orphan)
    mark_as_shard_directory(orphan, save_dir)
    foreign = shards / "u4-18ee78e97eafec64"  # the same, but not marked as the plugin's
    shutil.copytree(kept[0], foreign)
    (foreign / MARKER).unlink()
    resume = _plugin_args([*training_args(corpus, save_dir, max_update=3), *TINY, *SHARDED,
                           "--restore-file", str(save_dir / "update2.ckpt")])
    broken = [*resume, "--encoder-attention-heads", "5"]  # fails as the model is built
    assert run_training(broken, nproc=1, plugin=True, check=False).returncode != 0
    assert orphan.is_dir()
    result = run_training(resume, nproc=1, plugin=True)
    assert "(epoch 1 @ 2 updates)" in result.output  # resumed from the index set aside
    assert f"removed {orphan}: no checkpoint refers to it any more" in result.output
    assert not orphan.exists() and foreign.is_dir()
    assert all(directory.is_dir() for directory in kept)
    assert check(save_dir / "update2.ckpt").intact


def test_a_symlink_as_the_lock_file_is_not_followed(tmp_path: Path) -> None:
    """The lock file is truncated and written by its holder: through a link planted under
    its name that would change another file."""
    from fairseq_shard_plugin.checkpoint.save_dir_claim import SaveDirInUseError

    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    save_dir = tmp_path / "save"
    save_dir.mkdir()
    (save_dir / LOCK_NAME).symlink_to(precious)
    with pytest.raises(SaveDirInUseError, match=r"^.*/save/\.fairseq-shard-plugin\.lock is a "
                       "symbolic link, not the plugin's lock file .*: remove it$"):
        with claimed_save_dir(str(save_dir)):
            pass
    assert precious.read_text() == "keep me" and (save_dir / LOCK_NAME).is_symlink()


@pytest.mark.parametrize(("make", "kind"), [(os.mkdir, "a directory"),
                                            (os.mkfifo, "not a regular file")])
def test_a_lock_file_that_is_no_file_is_named(tmp_path: Path, make, kind: str) -> None:
    """A directory was "cannot write to the save dir" (wrong advice); a FIFO was taken as a
    lock, and a second run failed reading its holder (Illegal seek)."""
    from fairseq_shard_plugin.checkpoint.save_dir_claim import SaveDirInUseError

    make(tmp_path / LOCK_NAME)
    with pytest.raises(SaveDirInUseError,
                       match=re.escape(f"{tmp_path / LOCK_NAME} is {kind}, not the ")):
        with claimed_save_dir(str(tmp_path)):
            pass


def test_a_save_dir_is_held_until_the_block_ends(tmp_path: Path) -> None:
    import fcntl

    with claimed_save_dir(str(tmp_path / "save")):
        lock_file = tmp_path / "save" / LOCK_NAME
        assert lock_file.read_text().startswith("pid ")
        with open(lock_file) as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert not lock_file.exists()
    with claimed_save_dir(str(tmp_path / "save")):  # free again
        pass


def test_a_save_dir_that_is_a_file_is_named_so(tmp_path: Path) -> None:
    from fairseq_shard_plugin.checkpoint.save_dir_claim import SaveDirInUseError

    (tmp_path / "save").write_text("notes")
    with pytest.raises(SaveDirInUseError, match="save is a file, not a directory: give a "):
        with claimed_save_dir(str(tmp_path / "save")):
            pass


def test_processes_forked_while_it_is_held_do_not_hold_the_lock(tmp_path: Path) -> None:
    """fairseq's data loader workers, forked after the claim, kept the save dir locked for
    a while after their rank 0 was killed: a requeued run was refused."""
    import fcntl

    from fairseq_shard_plugin.checkpoint import save_dir_claim

    with claimed_save_dir(str(tmp_path)):
        held = save_dir_claim._held[0]
        assert held is not None
        child = os.fork()
        if child == 0:  # the worker: its copy of the descriptor is closed, the lock stays
            try:
                os.fstat(held)
                os._exit(2)  # still open here
            except OSError:
                pass
            try:
                with open(tmp_path / LOCK_NAME) as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os._exit(1)  # the lock was free: closing the copy released it
            except BlockingIOError:
                os._exit(0)
        assert os.waitpid(child, 0)[1] == 0


def test_the_shards_a_run_is_restored_from_stay_where_its_index_lives_elsewhere(
    corpus: Path, tmp_path: Path
) -> None:
    """An index outside the save dir whose checkpoint_shards is the save dir's (linked):
    its shards were removed right after the load, at the first update."""
    save_dir, other = tmp_path / "save", tmp_path / "other"
    run_training(_plugin_args([*training_args(corpus, save_dir, max_update=2), *TINY,
                               *SHARDED]), nproc=1, plugin=True)
    other.mkdir()
    (other / SHARDS_DIR).symlink_to(save_dir / SHARDS_DIR)
    (save_dir / "checkpoint_last.pt").rename(other / "restored.pt")
    for leftover in save_dir.glob("*.pt"):
        leftover.unlink()
    run_training(_plugin_args([*training_args(corpus, save_dir, max_update=3), *TINY,
                               *SHARDED, "--restore-file", str(other / "restored.pt")]),
                 nproc=1, plugin=True)
    assert check(other / "restored.pt").intact
