"""Sharded-format checkpoints (``--checkpoint-format sharded``) at the edges of shard cleanup:
files beside the indexes that are no checkpoints (a checksum ``checkpoint_last.pt.md5``) do
not stop it, damaged copies still do; and an export whose checkpoint a training's save
replaces or removes while it is read (its shards deleted by the cleanup) ends in one line.

One tiny training on one CPU rank writes the sharded checkpoints of updates 2 and 4; each
test works on a copy of its save dir, whose shard directories are marked for the copy as
the plugin marks them for a save dir.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from fairseq_shard_plugin.checkpoint import consolidate
from fairseq_shard_plugin.checkpoint.reading import read_checkpoint
from fairseq_shard_plugin.checkpoint.shard_metadata import SafeFileSystemReader
from fairseq_shard_plugin.checkpoint.sharded import (
    SHARDS_DIR,
    mark_as_shard_directory,
    remove_unreferenced_shards,
    shard_directory,
)
from fairseq_shard_plugin.checkpoint.stored_tensors import StoredTensorError, dcp_tensors
from launching.harness import run_training, training_args

from tiny_training import SHARDED, TINY

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)

SAVES = ("--save-interval-updates", "2", "--no-epoch-checkpoints", "--disable-validation")


def _args(corpus: Path, save_dir: Path, updates: int, *extra: str) -> list[str]:
    return training_args(corpus, save_dir, updates) + TINY + [
        "--task", "sharded_translation", *SHARDED, *SAVES, *extra]


@pytest.fixture(scope="module")
def trained(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save dir with the sharded checkpoints of updates 2 and 4 (and checkpoint_last.pt,
    of update 4), written by a real training on one rank."""
    save_dir = tmp_path_factory.mktemp("sharded_cleanup") / "save"
    run_training(_args(corpus, save_dir, 4), nproc=1, plugin=True)
    assert {p.name for p in save_dir.glob("*.pt")} == {
        "checkpoint_1_2.pt", "checkpoint_1_4.pt", "checkpoint_last.pt"}
    return save_dir


@pytest.fixture
def save_dir(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained save dir, its shard directories marked as this one's."""
    copy = shutil.copytree(trained, tmp_path / "save", symlinks=True)
    for directory in (copy / SHARDS_DIR).iterdir():
        mark_as_shard_directory(directory, copy)
    return copy


def _shards_of(save_dir: Path, name: str) -> Path:
    index = save_dir / name
    return shard_directory(index, read_checkpoint(index))


def _shard_directories(save_dir: Path) -> set[Path]:
    return {path.resolve() for path in (save_dir / SHARDS_DIR).iterdir()}


def _md5_sidecar(checkpoint: Path) -> Path:
    """``md5sum checkpoint > checkpoint.md5``, as a user keeps beside a checkpoint."""
    digest = hashlib.md5(checkpoint.read_bytes()).hexdigest()
    sidecar = checkpoint.with_name(checkpoint.name + ".md5")
    sidecar.write_text(f"{digest}  {checkpoint.name}\n")
    return sidecar


# ---------------------------------------------------------------- cleanup


def test_a_checksum_beside_the_indexes_does_not_stop_cleanup(
    save_dir: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """checkpoint_last.pt.md5 is named like a copy of an index but is text: not read as
    one, so the shards of update 2 go once no checkpoint names them."""
    sidecar = _md5_sidecar(save_dir / "checkpoint_last.pt")
    text = sidecar.read_text()
    older = _shards_of(save_dir, "checkpoint_1_2.pt")
    (save_dir / "checkpoint_1_2.pt").unlink()  # as --keep-interval-updates 1 does
    with caplog.at_level("WARNING"):
        removed = remove_unreferenced_shards(save_dir, read_checkpoint)
    assert [path.resolve() for path in removed] == [older]
    assert _shard_directories(save_dir) == {_shards_of(save_dir, "checkpoint_last.pt")}
    assert "kept every shard directory" not in caplog.text
    assert sidecar.read_text() == text


@pytest.mark.parametrize("copy", ["truncated", "empty"])
def test_a_damaged_or_unfinished_copy_of_an_index_still_keeps_every_shard_directory(
    save_dir: Path, copy: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A copy that is a torch file, but cut short (or an empty one, a copy just begun), may
    refer to any shard directory: none is deleted, and the warning names it."""
    data = (save_dir / "checkpoint_1_2.pt").read_bytes()
    backup = save_dir / "checkpoint_1_2.pt.bak"
    backup.write_bytes(data[: len(data) // 2] if copy == "truncated" else b"")
    (save_dir / "checkpoint_1_2.pt").unlink()
    before = _shard_directories(save_dir)
    with caplog.at_level("WARNING"):
        assert remove_unreferenced_shards(save_dir, read_checkpoint) == []
    assert _shard_directories(save_dir) == before and len(before) == 2
    assert f"kept every shard directory in {save_dir / SHARDS_DIR}: {backup} could not be " \
           "read" in caplog.text


def test_a_resumed_training_with_a_checksum_sidecar_keeps_only_the_shards_it_needs(
    corpus: Path, save_dir: Path,
) -> None:
    """The tester's case: with --keep-interval-updates 1, a checkpoint_last.pt.md5 made
    aside no longer makes every save keep every shard directory."""
    sidecar = _md5_sidecar(save_dir / "checkpoint_last.pt")
    result = run_training(_args(corpus, save_dir, 8, "--keep-interval-updates", "1"),
                          nproc=1, plugin=True)
    assert "kept every shard directory" not in result.output
    indexes = sorted(p.name for p in save_dir.glob("*.pt"))
    assert indexes == ["checkpoint_1_8.pt", "checkpoint_last.pt"]
    assert _shard_directories(save_dir) == {_shards_of(save_dir, name) for name in indexes}
    assert sidecar.exists()


# ---------------------------------------------------------------- exports racing a training


def _save_of_update_4(save_dir: Path) -> None:
    """What a training's next save does to a save dir whose checkpoint_last.pt is update
    2's, with --keep-interval-updates 1: update 4's index is copied over
    checkpoint_last.pt (a rename), update 2's is deleted, then the shards no index names."""
    shutil.copy(save_dir / "checkpoint_1_4.pt", save_dir / ".next")
    os.replace(save_dir / ".next", save_dir / "checkpoint_last.pt")
    (save_dir / "checkpoint_1_2.pt").unlink()
    assert remove_unreferenced_shards(save_dir, read_checkpoint)


@pytest.fixture
def at_update_2(save_dir: Path) -> Path:
    """The save dir as it was right after update 2's save (update 4's index aside)."""
    shutil.copy(save_dir / "checkpoint_1_2.pt", save_dir / ".last")
    os.replace(save_dir / ".last", save_dir / "checkpoint_last.pt")
    return save_dir


def test_a_shard_file_removed_before_its_chunks_are_read_is_one_line(save_dir: Path) -> None:
    directory = _shards_of(save_dir, "checkpoint_1_2.pt")
    metadata = SafeFileSystemReader(directory).read_metadata()
    shard_file = sorted(directory.glob("*.distcp"))[0]
    shard_file.unlink()
    with pytest.raises(StoredTensorError, match=f"could not read {shard_file}: No such file "
                       r"or directory \(ENOENT\)") as failed:
        dcp_tensors(directory, metadata, list(metadata.state_dict_metadata))
    assert "\n" not in str(failed.value)


@pytest.mark.parametrize("step", ["dcp_tensors", "write_checkpoint"])
def test_an_export_whose_shards_a_training_removes_while_it_reads_them_is_one_line(
    at_update_2: Path, monkeypatch: pytest.MonkeyPatch, step: str,
) -> None:
    """The save of update 4 happens after the export has read checkpoint_last.pt and its
    shards' metadata, before it reads their chunks (``dcp_tensors``) or while it writes
    (``write_checkpoint`` reads the tensors): its shard files are gone."""
    real = getattr(consolidate, step)

    def save_first(*args: object) -> object:
        _save_of_update_4(at_update_2)
        return real(*args)

    monkeypatch.setattr(consolidate, step, save_first)
    out = at_update_2.parent / "out"
    with pytest.raises(consolidate.ConsolidateError) as failed:
        consolidate.export_consolidated(at_update_2, out / "model.pt")
    assert str(failed.value) == (
        f"{at_update_2 / 'checkpoint_last.pt'} was replaced while it was read (a training "
        "saving into its save dir?): nothing was written; run the export again, or export a "
        "checkpoint the training no longer writes or removes (e.g. a copy such as "
        "checkpoint_last.pt.bak beside it)")
    assert not out.exists() or list(out.iterdir()) == []  # no temporary file left


def test_an_export_of_a_checkpoint_a_training_deletes_while_it_reads_is_one_line(
    at_update_2: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """checkpoint_1_2.pt named itself: --keep-interval-updates deletes it, with its shards."""
    real = consolidate.dcp_tensors

    def save_first(*args: object) -> object:
        _save_of_update_4(at_update_2)
        return real(*args)

    monkeypatch.setattr(consolidate, "dcp_tensors", save_first)
    source = at_update_2 / "checkpoint_1_2.pt"
    with pytest.raises(consolidate.ConsolidateError, match=(
            f"^{source} was removed while it was read .*: nothing was written; run the "
            "export again")):
        consolidate.export_consolidated(source, at_update_2.parent / "model.pt")
    assert not (at_update_2.parent / "model.pt").exists()


def test_the_export_the_race_spared_still_works(at_update_2: Path) -> None:
    """Without a save in between, the same export is written."""
    written = consolidate.export_consolidated(at_update_2, at_update_2.parent / "model.pt")
    assert "model" in read_checkpoint(written)


def test_an_index_set_aside_under_another_name_keeps_its_shards_in_either_format(
    save_dir: Path, tmp_path: Path,
) -> None:
    """Any name counts for an index as torch.save writes it (zip or legacy format); a
    TorchScript archive or an .npz beside it neither counts nor stops the cleanup."""
    import numpy as np
    import torch

    index = read_checkpoint(save_dir / "checkpoint_1_2.pt")
    torch.save(index, save_dir / "keep_me", _use_new_zipfile_serialization=False)
    (save_dir / "checkpoint_1_2.pt").unlink()
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), save_dir / "model.ts")
    np.savez(save_dir / "attention.npz", counts=np.arange(3))
    kept = _shards_of(save_dir, "keep_me")
    assert remove_unreferenced_shards(save_dir, read_checkpoint) == []
    assert kept.is_dir()
    (save_dir / "keep_me").rename(tmp_path / "keep_me")  # restored from elsewhere: kept
    assert remove_unreferenced_shards(save_dir, read_checkpoint, also_kept=kept) == []
    assert remove_unreferenced_shards(save_dir, read_checkpoint) == [kept]


def test_the_reset_advice_counts_a_save_dir_whose_last_checkpoint_is_a_link(
    tmp_path: Path,
) -> None:
    from fairseq_shard_plugin.checkpoint.errors import RESET_OPTIMIZER, keeping_the_save_dir

    (tmp_path / "elsewhere.pt").write_bytes(b"")
    (tmp_path / "save").mkdir()
    (tmp_path / "save" / "checkpoint_last.pt").symlink_to(tmp_path / "elsewhere.pt")
    advised = keeping_the_save_dir(f"x; {RESET_OPTIMIZER}", str(tmp_path / "save" /
                                                               "checkpoint_last.pt"),
                                   str(tmp_path / "save"))
    assert RESET_OPTIMIZER not in advised and "--finetune-from-model" in advised
