"""``fairseq-shard-verify`` on files crafted to be odd rather than damaged: each is reported
in one line, the other files are still listed, and nothing outside the checkpoint is read.

Every file here is written by the test with ``torch.save`` or ``save_sharded`` (in a
one-rank gloo group), then altered with ``zipfile`` or the file system; no training runs.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fairseq_shard_plugin.checkpoint import consolidate, integrity, verify
from fairseq_shard_plugin.checkpoint.integrity import (
    RESUME_HINT,
    UnreadableEntry,
    UnsafeShardFileError,
    damaged_zip_entries,
    mismatched_shard_files,
)
from fairseq_shard_plugin.checkpoint.sharded import SHARDED_KEY, save_sharded
from fairseq_shard_plugin.cli import verify as cli_verify

from tiny_training import one_rank_group

_file_crc32 = integrity.file_crc32


def _fairseq_state(**changed: Any) -> dict[str, Any]:
    """A small state with the fields fairseq's resume reads, ``changed`` replacing some."""
    state = {"model": {"w": torch.arange(4.0)}, "last_optimizer_state": {},
             "optimizer_history": [{"num_updates": 6}],
             "extra_state": {"train_iterator": {"epoch": 1}}}
    return {**state, **changed}


# ---------------------------------------------------------------- fields of odd types


@pytest.mark.parametrize(("changed", "problem"), [
    ({"optimizer_history": [1]}, "its optimizer_history[-1] is an int, not a dict"),
    ({"optimizer_history": "x"}, "its optimizer_history is a str, not a list"),
    ({"optimizer_history": [{"num_updates": "abc"}]},
     "its optimizer_history[-1]['num_updates'] is a str, not an int"),
    ({"optimizer_history": [{"num_updates": True}]},
     "its optimizer_history[-1]['num_updates'] is a bool, not an int"),
    ({"extra_state": [1]}, "its extra_state is a list, not a dict"),
    ({"extra_state": {"train_iterator": 5}},
     "its extra_state['train_iterator'] is an int, not a dict"),
    ({"extra_state": {"train_iterator": {"epoch": [1]}}},
     "its extra_state['train_iterator']['epoch'] is a list, not an int"),
], ids=["history_item", "history", "updates_str", "updates_bool", "extra_state",
        "train_iterator", "epoch"])
def test_a_field_of_an_odd_type_is_named_in_one_line(
    tmp_path: Path, changed: dict[str, Any], problem: str
) -> None:
    path = tmp_path / "checkpoint_last.pt"
    torch.save(_fairseq_state(**changed), path)
    verdict = verify.check(path)
    assert not verdict.intact and not verdict.resumable
    assert verdict.line == f"{path}: not a usable fairseq checkpoint ({problem})"


def test_absent_fields_are_still_shown_as_unknown(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint_last.pt"
    torch.save(_fairseq_state(optimizer_history=[], extra_state=None), path)
    verdict = verify.check(path)
    assert verdict.intact and verdict.line == f"{path}: ok (full, update ?, resumes in epoch ?)"


def test_the_other_files_are_still_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save(_fairseq_state(), tmp_path / "checkpoint_1_6.pt")
    torch.save(_fairseq_state(extra_state=[1]), tmp_path / "checkpoint_last.pt")
    with pytest.raises(SystemExit) as exit_:
        cli_verify.main([str(tmp_path)])
    assert exit_.value.code == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{tmp_path / 'checkpoint_1_6.pt'}: ok (full, update 6, resumes in epoch 1)",
                     f"{tmp_path / 'checkpoint_last.pt'}: not a usable fairseq checkpoint "
                     "(its extra_state is a list, not a dict)",
                     "1 of 2 checkpoints cannot be resumed from"]


def test_each_line_is_printed_before_the_next_file_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever stops the listing (a bug, Ctrl-C on a slow disk), the files checked so far
    have been listed."""
    for name in ("checkpoint_1_6.pt", "checkpoint_last.pt"):
        torch.save(_fairseq_state(), tmp_path / name)

    def check(path: Path) -> verify.Verdict:
        if path.name == "checkpoint_last.pt":
            raise KeyboardInterrupt
        return verify.check(path)

    monkeypatch.setattr(cli_verify, "check", check)
    with pytest.raises(KeyboardInterrupt):
        cli_verify.main([str(tmp_path)])
    assert capsys.readouterr().out.splitlines() == [
        f"{tmp_path / 'checkpoint_1_6.pt'}: ok (full, update 6, resumes in epoch 1)"]


def test_a_rank_file_with_an_odd_cfg_is_described(tmp_path: Path) -> None:
    """One rank's file of stock fully_sharded state: its world size is read from ``cfg``,
    which fairseq writes as a mapping: anything else is named (it was read past)."""
    path = tmp_path / "checkpoint_last-shard1.pt"
    torch.save(_fairseq_state(fsdp_metadata={}, cfg=[1]), path)
    verdict = verify.check(path)
    assert not verdict.intact
    assert verdict.line == (f"{path}: not a usable fairseq checkpoint (its cfg is a list, not "
                            "a config mapping)"), verdict.line
    torch.save(_fairseq_state(fsdp_metadata={}, cfg={"distributed_training": [1]}), path)
    verdict = verify.check(path)
    assert not verdict.intact
    assert verdict.line.endswith("without its set's NAME-shard0.pt beside it"), verdict.line


# ---------------------------------------------------------------- zip entries torch never writes


def _with_odd_entry(path: Path, how: str) -> None:
    """Append entry ``STEM/zzextra`` to the zip at ``path`` (torch.save's entries are all
    under the file's stem), then flag it encrypted or give it compression method 99 (in its
    central directory record and its local header)."""
    with zipfile.ZipFile(path, "a", zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{path.stem}/zzextra", b"hello")
    data = bytearray(path.read_bytes())
    record = data.rfind(b"PK\x01\x02")  # the central directory record of the last entry
    header = struct.unpack_from("<I", data, record + 42)[0]
    field, offset = (8, 6) if how == "encrypted" else (10, 8)
    value = 1 if how == "encrypted" else 99
    struct.pack_into("<H", data, record + field, value)
    struct.pack_into("<H", data, header + offset, value)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("how", "reason"), [
    ("encrypted", "it is encrypted"),
    ("method99", "compression method 99, flags 0x0: NotImplementedError: "),
])
def test_an_entry_that_cannot_be_read_is_named_in_one_line(
    tmp_path: Path, how: str, reason: str
) -> None:
    path = tmp_path / "checkpoint_last.pt"
    torch.save(_fairseq_state(), path)
    _with_odd_entry(path, how)
    expected = (f"{path}: corrupted checkpoint: checkpoint_last/zzextra cannot be read back "
                f"({reason}")
    verdict = verify.check(path)
    assert not verdict.intact and verdict.line.startswith(expected), verdict.line
    assert "\n" not in verdict.line and verdict.line.endswith(RESUME_HINT)
    with pytest.raises(consolidate.ConsolidateError, match=re.escape(expected)):
        consolidate.export_consolidated(path, tmp_path / "out.pt")
    assert damaged_zip_entries(path, collective=True) == ["checkpoint_last/zzextra"]


def test_the_reason_survives_the_gathering_from_every_rank() -> None:
    """``damaged_zip_entries(collective=True)`` pickles the names to every rank."""
    entry = pickle.loads(pickle.dumps(UnreadableEntry("archive/x", "it is encrypted")))
    assert isinstance(entry, UnreadableEntry)
    assert (entry, entry.reason) == ("archive/x", "it is encrypted")


# ---------------------------------------------------------------- a sharded index's checksums


class _Reads:
    """Records which files ``file_crc32`` opens."""

    def __init__(self) -> None:
        self.paths: list[Path] = []

    def __call__(self, path: Path) -> int:
        self.paths.append(path)
        return _file_crc32(path)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> _Reads:
    recorder = _Reads()
    monkeypatch.setattr(integrity, "file_crc32", recorder)
    return recorder


def _shard_dir(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    """A directory with one shard file and its checksum."""
    directory = tmp_path / "shards"
    directory.mkdir()
    (directory / "__0_0.distcp").write_bytes(b"tensor bytes")
    return directory, {"__0_0.distcp": _file_crc32(directory / "__0_0.distcp")}


@pytest.mark.parametrize("kind", ["symlink_out", "dangling_out", "fifo", "fifo_link",
                                  "directory", "symlink_loop"])
def test_a_checksummed_name_that_is_no_regular_file_inside_is_not_opened(
    tmp_path: Path, reads: _Reads, kind: str
) -> None:
    directory, checksums = _shard_dir(tmp_path)
    extra = directory / "extra.distcp"
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not the plugin's")
    if kind == "symlink_out":
        extra.symlink_to(outside)
    elif kind == "dangling_out":
        extra.symlink_to(tmp_path / "nowhere")
    elif kind == "fifo":
        os.mkfifo(extra)
    elif kind == "fifo_link":
        os.mkfifo(directory / "pipe")
        extra.symlink_to("pipe")
    elif kind == "directory":
        extra.mkdir()
    else:
        extra.symlink_to("extra.distcp")
    with pytest.raises(UnsafeShardFileError) as error:
        mismatched_shard_files(directory, {**checksums, "extra.distcp": 0})
    message = str(error.value)
    assert message.startswith(f"the sharded checkpoint's checksums name {extra}, which ")
    assert message.endswith(f": refused unread; {RESUME_HINT}") and "\n" not in message
    assert reads.paths == []


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/passwd", "..", "", 7])
def test_a_checksummed_name_that_is_no_file_name_is_not_opened(
    tmp_path: Path, reads: _Reads, name: Any
) -> None:
    directory, checksums = _shard_dir(tmp_path)
    with pytest.raises(UnsafeShardFileError, match=re.escape(
            f"checksums name {str(name)!r}, which is not a file name of {directory}")):
        mismatched_shard_files(directory, {**checksums, name: 0})
    assert reads.paths == []


def test_a_symlink_inside_its_directory_is_still_checked(tmp_path: Path, reads: _Reads) -> None:
    directory, checksums = _shard_dir(tmp_path)
    (directory / "copy.distcp").symlink_to("__0_0.distcp")
    assert mismatched_shard_files(directory, {**checksums, "copy.distcp": 1}) == ["copy.distcp"]
    assert len(reads.paths) == 2


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A save dir with one genuine sharded checkpoint, saved in a one-rank gloo group."""
    root = tmp_path_factory.mktemp("sharded")
    with one_rank_group(root):
        save_dir = root / "save"
        index = save_sharded(_fairseq_state(), save_dir, num_updates=6)
        torch.save(index, save_dir / "checkpoint_last.pt")
        yield save_dir


def test_verify_refuses_a_checksummed_symlink_out_in_one_line(
    sharded: Path, tmp_path: Path, reads: _Reads
) -> None:
    save_dir = tmp_path / "save"
    shutil.copytree(sharded, save_dir)
    index_file = save_dir / "checkpoint_last.pt"
    assert verify.check(index_file).intact
    reads.paths.clear()
    index = torch.load(index_file, weights_only=True)
    directory = save_dir / index[SHARDED_KEY]["dir"]
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    (directory / "extra.distcp").symlink_to(outside)
    index[SHARDED_KEY]["crc32"]["extra.distcp"] = 0
    torch.save(index, index_file)
    verdict = verify.check(index_file)
    assert not verdict.intact
    assert verdict.line.startswith(f"{index_file}: the sharded checkpoint's checksums name "
                                   f"{directory / 'extra.distcp'}, which resolves to "
                                   f"{outside}, outside its directory"), verdict.line
    assert reads.paths == []


def test_a_fifo_given_to_verify_is_named_for_what_it_is(tmp_path: Path) -> None:
    """It said "no such file or directory" for a FIFO that exists (inferT #6)."""
    from fairseq_shard_plugin.checkpoint.verify import checkpoint_files

    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    with pytest.raises(FileNotFoundError, match=f"^{fifo}: not a regular file or directory$"):
        checkpoint_files([str(fifo)])
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        checkpoint_files([str(tmp_path / "gone.pt")])
    # in a save dir: listed, damaged, never opened (the listing went on past it; it had
    # stopped there, and a directory or a dangling link under a checkpoint's name passed)
    (tmp_path / "checkpoint_last.pt").mkdir()
    (tmp_path / "checkpoint_best.pt").symlink_to(tmp_path / "gone")
    listed = checkpoint_files([str(tmp_path)])
    assert [path.name for path in listed] == ["checkpoint_best.pt", "checkpoint_last.pt",
                                              "pipe.pt"]
    assert [verify.check(path).line for path in listed] == [
        f"{tmp_path / name}: {kind}, not a checkpoint file (a resume refuses it: move it out "
        "of the save dir)" for name, kind in [("checkpoint_best.pt", "a link to nothing"),
                                             ("checkpoint_last.pt", "a directory"),
                                             ("pipe.pt", "a FIFO, socket or device")]]
