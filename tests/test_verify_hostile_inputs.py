"""``fairseq-shard-verify`` on files crafted to be odd rather than damaged: each is reported
in one line, the other files are still listed, and nothing outside the checkpoint is read.

Every file here is written by the test with ``torch.save`` (and altered with ``zipfile``
or the file system); no training runs.
"""

from __future__ import annotations

import pickle
import re
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from fairseq_shard_plugin.checkpoint import consolidate, verify
from fairseq_shard_plugin.checkpoint.integrity import (
    RESUME_HINT,
    UnreadableEntry,
    damaged_zip_entries,
)
from fairseq_shard_plugin.cli import verify as cli_verify


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
    assert verdict.intact and verdict.line == f"{path}: ok (full, update ?, epoch ?)"


def test_the_other_files_are_still_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save(_fairseq_state(), tmp_path / "checkpoint_1_6.pt")
    torch.save(_fairseq_state(extra_state=[1]), tmp_path / "checkpoint_last.pt")
    with pytest.raises(SystemExit) as exit_:
        cli_verify.main([str(tmp_path)])
    assert exit_.value.code == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{tmp_path / 'checkpoint_1_6.pt'}: ok (full, update 6, epoch 1)",
                     f"{tmp_path / 'checkpoint_last.pt'}: not a usable fairseq checkpoint "
                     "(its extra_state is a list, not a dict)",
                     "1 of 2 checkpoints cannot be resumed from"]


def test_a_rank_file_with_an_odd_cfg_is_described(tmp_path: Path) -> None:
    """One rank's file of stock fully_sharded state: its world size is read from ``cfg``."""
    path = tmp_path / "checkpoint_last-shard1.pt"
    torch.save(_fairseq_state(fsdp_metadata={}, cfg=[1]), path)
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
