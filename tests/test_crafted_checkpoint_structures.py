"""Checkpoints whose structure is crafted (weights_only=True admits it) get one line, at once.

Every file here loads under ``torch.load(weights_only=True)``: it holds only lists, dicts,
ints and allow-listed numpy types, but shaped as no fairseq checkpoint is: lists that share
each other (60 of them make 2**60 paths), lists nested 300,000 deep, an object array made by
calling the allow-listed ``numpy.dtype``, a shard reference that is not a path, a DCP
``.metadata`` whose planner data shares lists or that is a FIFO, a shard chunk holding a
pickled ``os.system``. Each must be refused by verify, consolidate and the loaders in one
line naming the cause, never hang, never print a traceback.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import shutil
import signal
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest
import torch

from fairseq_shard_plugin.checkpoint import consolidate, verify
from fairseq_shard_plugin.checkpoint.portable import plain
from fairseq_shard_plugin.checkpoint.reading import (
    CheckpointStructureError,
    check_structure,
    private_copies_of_mapped,
    read_checkpoint,
)
from fairseq_shard_plugin.checkpoint.safe_loading import allow_fairseq_checkpoint_types
from fairseq_shard_plugin.checkpoint.shard_metadata import (
    SafeFileSystemReader,
    UnsafeMetadataError,
    load_metadata,
)
from fairseq_shard_plugin.checkpoint.sharded import (
    SHARDED_KEY,
    ShardedCheckpointError,
    fill_tensors,
    full_tensors,
    load_tensors,
    read_shard_metadata,
    save_sharded,
    split_tensors,
    tensor_paths,
)
from fairseq_shard_plugin.cli import consolidate as cli_consolidate
from launching.harness import PLUGIN_DIR, run_command, tool

from tiny_training import one_rank_group

PLACEHOLDER = "CRAFTED_PART_PLACEHOLDER"
SECONDS = 20  # each test's limit: a walk along every path of a crafted file never ends


@pytest.fixture(autouse=True)
def _time_limit() -> Iterator[None]:
    """Fail a test that runs past :data:`SECONDS` (the defects here were hangs)."""
    def expire(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"still running after {SECONDS} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _shared_lists(levels: int) -> list[Any]:
    """``levels`` lists, each holding the one below twice: 2**levels paths, levels objects."""
    shared: list[Any] = [1]
    for _ in range(levels):
        shared = [shared, shared]
    return shared


def _training_state(extra: Any = PLACEHOLDER) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    return {"model": {"encoder.embed_tokens.weight": torch.randn(8, 4, generator=generator)},
            "cfg": {"model": {"_name": "transformer"}},
            "optimizer_history": [{"num_updates": 4}],
            "extra_state": {"train_iterator": {"epoch": 1}, "crafted": extra},
            "last_optimizer_state": {"state": {0: {"exp_avg": torch.zeros(8, 4)}}}}


def _pickled_string(text: str) -> bytes:
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data  # BINUNICODE


def _save_with_opcodes(path: Path, opcodes: bytes, legacy: bool = False) -> Path:
    """A training checkpoint whose ``extra_state['crafted']`` is made by raw pickle
    ``opcodes`` (in place of the placeholder string's), in either torch format."""
    buffer = io.BytesIO()
    torch.save(_training_state(), buffer, _use_new_zipfile_serialization=not legacy)
    placeholder = _pickled_string(PLACEHOLDER)
    if legacy:
        assert buffer.getvalue().count(placeholder) == 1
        path.write_bytes(buffer.getvalue().replace(placeholder, opcodes))
        return path
    with zipfile.ZipFile(buffer) as source, zipfile.ZipFile(path, "w") as crafted:
        for entry in source.infolist():
            data = source.read(entry.filename)
            if entry.filename.endswith("/data.pkl"):
                assert data.count(placeholder) == 1
                data = data.replace(placeholder, opcodes)
            crafted.writestr(entry, data)
    return path


def _refused_everywhere(path: Path, words: str, tmp_path: Path) -> None:
    """verify, consolidate (its function and its command) and the loader all refuse
    ``path`` in one line that holds ``words``."""
    allow_fairseq_checkpoint_types()
    verdict = verify.check(path)
    assert not verdict.intact and words in verdict.line and "\n" not in verdict.line, verdict.line
    assert verdict.line.startswith(f"{path}: ")
    with pytest.raises(consolidate.ConsolidateError) as refused:
        consolidate.export_consolidated(path, tmp_path / "model.pt")
    assert words in str(refused.value) and "\n" not in str(refused.value), refused.value
    with pytest.raises(SystemExit) as stopped:
        cli_consolidate.main([str(path), str(tmp_path / "model.pt")])
    assert words in str(stopped.value.code) and "\n" not in str(stopped.value.code)
    assert not (tmp_path / "model.pt").exists()


# ---------------------------------------------------------------- shared and deep lists


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_lists_sharing_each_other_are_refused_at_once(tmp_path: Path, legacy: bool) -> None:
    path = tmp_path / "checkpoint_last.pt"
    torch.save(_training_state(_shared_lists(60)), path, _use_new_zipfile_serialization=not legacy)
    assert path.stat().st_size < 10_000
    with pytest.raises(CheckpointStructureError, match="more than 10,000,000 entries"):
        read_checkpoint(path)
    _refused_everywhere(path, "more than 10,000,000 entries counted along every path", tmp_path)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_lists_nested_300000_deep_are_refused_as_too_deep(tmp_path: Path, legacy: bool) -> None:
    """Not as a truncated file (zip), nor passed by verify and then a RecursionError
    traceback from consolidate (legacy)."""
    depth = 300_000
    path = _save_with_opcodes(tmp_path / "checkpoint_last.pt",
                              b"]" * depth + b"a" * (depth - 1), legacy)
    _refused_everywhere(path, "lists or dicts nested more than 100 deep", tmp_path)
    assert "truncated" not in verify.check(path).line


@pytest.mark.e2e
def test_fairseq_generate_with_the_plugin_refuses_them_in_one_line(
    corpus: Path, tmp_path: Path
) -> None:
    """verify and consolidate said one line; fairseq-generate printed the refusal (or
    torch's advice to load with weights_only=False) inside a traceback."""
    shared = tmp_path / "shared.pt"
    torch.save(_training_state(_shared_lists(60)), shared)
    runs = _save_with_opcodes(tmp_path / "runs.pt", _global("os", "system")
                              + _pickled_string("true") + b"\x85R")  # os.system("true")
    for path, words in ((shared, "more than 10,000,000 entries"),
                        (runs, "holds a pickled os.system, which the plugin does not load")):
        generated = run_command([tool("fairseq-generate"), str(corpus), "--path", str(path),
                                 "--cpu", "--user-dir", str(PLUGIN_DIR), "--task",
                                 "sharded_translation"], timeout=120)
        assert generated.returncode != 0
        last = generated.stderr.strip().splitlines()[-1]
        assert last.startswith(f"fairseq-shard-plugin: error: {path}: ") and words in last, \
            generated.stderr[-3000:]
        assert "Traceback" not in generated.stderr and "weights_only` set to `False" not in \
            generated.stderr


def test_a_list_that_contains_itself_is_refused() -> None:
    looped: list[Any] = [1]
    looped.append(looped)
    with pytest.raises(CheckpointStructureError, match="a list or dict that contains itself"):
        check_structure({"extra_state": looped})


def test_a_shared_list_just_past_the_depth_limit_is_refused() -> None:
    """The 50 lists below are measured once, at depth 1; met again under 55 more lists they
    nest 106 deep (under 40, 91)."""
    def wrapped(value: Any, times: int) -> Any:
        for _ in range(times):
            value = [value]
        return value

    below = wrapped(0, 50)
    check_structure([below, wrapped(below, 40)])
    with pytest.raises(CheckpointStructureError, match="nested more than 100 deep"):
        check_structure([below, wrapped(below, 55)])


def test_genuine_structures_pass_and_keep_their_sharing() -> None:
    tied = torch.zeros(3)
    settings = {"lr": [0.1], "betas": (0.9, 0.98)}
    state = {"model": {"a": tied, "b": tied}, "groups": [settings, settings],
             "args": argparse.Namespace(langs=["en", "de"], metric=np.float64(2))}
    check_structure(state)
    converted = plain(state)
    assert converted["groups"][0] is converted["groups"][1]
    assert converted["args"] == {"langs": ["en", "de"], "metric": 2.0}


def test_the_plugins_walks_visit_a_shared_list_once() -> None:
    """split/fill/tensor_paths, plain and private_copies_of_mapped on 2**60 paths."""
    tensor = torch.arange(4)
    shared = _shared_lists(60)
    state = {"model": {"w": tensor}, "extra": shared, "again": shared}
    skeleton, tensors = split_tensors(state)
    assert list(tensors) == ["model/w"]
    assert tensor_paths(skeleton) == ["model/w"]
    filled = fill_tensors(skeleton, tensors)
    assert filled["model"]["w"] is tensor and filled["extra"] is filled["again"]
    converted = plain(state)
    assert converted["extra"] is converted["again"] and converted["extra"][0] is \
        converted["extra"][1]
    assert private_copies_of_mapped(state) == 0


# ---------------------------------------------------------------- numpy object arrays


def _global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def _object_array_opcodes() -> bytes:
    """An object array ['hello', 5], its dtype made by calling numpy.dtype('O')."""
    return (_global("numpy._core.multiarray", "_reconstruct") + _global("numpy", "ndarray")
            + b"K\x00\x85" + _pickled_string("b") + b"\x87R"
            + b"(K\x01K\x02\x85" + _global("numpy", "dtype") + _pickled_string("O") + b"\x85R"
            + b"\x89](" + _pickled_string("hello") + b"K\x05etb")


def _reconstructed_object_array_opcodes() -> bytes:
    """An object array of two Nones, made by _reconstruct with the dtype code 'O' alone."""
    return (_global("numpy._core.multiarray", "_reconstruct") + _global("numpy", "ndarray")
            + b"K\x02\x85" + _pickled_string("O") + b"\x87R")


@pytest.mark.parametrize("opcodes", [_object_array_opcodes(),
                                     _reconstructed_object_array_opcodes()],
                         ids=["dtype_O", "reconstruct_O"])
def test_an_object_array_is_refused_by_its_dtype(tmp_path: Path, opcodes: bytes) -> None:
    path = _save_with_opcodes(tmp_path / "checkpoint_last.pt", opcodes)
    _refused_everywhere(path, "holds a pickled numpy.dtypes.ObjectDType, which the plugin does "
                              "not load", tmp_path)


def test_a_string_dtype_is_refused_too(tmp_path: Path) -> None:
    opcodes = _global("numpy", "dtype") + _pickled_string("U5") + b"\x85R"
    path = _save_with_opcodes(tmp_path / "checkpoint_last.pt", opcodes)
    allow_fairseq_checkpoint_types()
    assert "holds a pickled numpy.dtypes.StrDType" in verify.check(path).line


def test_fairseqs_numeric_numpy_values_still_load(tmp_path: Path) -> None:
    """Meters' scalars, --eval-bleu's count arrays, a big-endian array, and a dtype pickled
    as numpy 1 did (its flags as the ints 0 and 1)."""
    values = {"scalar": np.float64(1.5), "count": np.int64(7),
              "counts": np.array([1, 2, 3]), "halves": np.array([0.5], dtype=np.float16),
              "big_endian": np.array([1.25, 2.5], dtype=">f8"), "flags": np.array([True])}
    path = tmp_path / "checkpoint_last.pt"
    torch.save(_training_state(values), path)
    allow_fairseq_checkpoint_types()
    loaded = read_checkpoint(path)["extra_state"]["crafted"]
    for name, value in values.items():  # (torch reads the big-endian one as native)
        assert loaded[name].dtype == value.dtype.newbyteorder("=") and np.array_equal(
            loaded[name], value), name
    numpy1 = _global("numpy", "dtype") + _pickled_string("f8") + b"K\x00K\x01\x87R"
    old = _save_with_opcodes(tmp_path / "numpy1.pt", numpy1)
    assert read_checkpoint(old)["extra_state"]["crafted"] == np.dtype("f8")


# ---------------------------------------------------------------- sharded checkpoints


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A save dir with one genuine sharded checkpoint, saved in a one-rank gloo group."""
    root = tmp_path_factory.mktemp("crafted_sharded")
    with one_rank_group(root):
        state = _training_state({"epoch": 1})
        state["model"]["encoder.version"] = torch.tensor([3.0])
        save_dir = root / "save"
        torch.save(save_sharded(state, save_dir, num_updates=4), save_dir / "checkpoint_last.pt")
        yield save_dir


def _copy(sharded: Path, destination: Path) -> tuple[Path, dict[str, Any], Path]:
    shutil.copytree(sharded, destination)
    index_file = destination / "checkpoint_last.pt"
    index = torch.load(index_file, weights_only=True)
    return index_file, index, destination / index[SHARDED_KEY]["dir"]


def _without_checksums(index_file: Path, index: dict[str, Any]) -> None:
    """As indexes written before checksums existed (still accepted)."""
    index[SHARDED_KEY].pop("crc32")
    torch.save(index, index_file)


def test_an_index_copied_without_its_shards_says_what_to_copy(
    sharded: Path, tmp_path: Path
) -> None:
    """fairseq's workflow of copying checkpoint_best.pt to another save dir: the error said
    only that the shard directory was missing and to resume from an intact checkpoint."""
    index_file, index, directory = _copy(sharded, tmp_path / "save")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    copied = Path(shutil.copy(index_file, elsewhere / "checkpoint_best.pt"))
    with pytest.raises(ShardedCheckpointError) as refused:
        read_shard_metadata(copied, index)
    assert (f"a copy of the file alone needs checkpoint_shards/{directory.name} copied "
            "beside it too, or export one standard file with fairseq-shard-consolidate"
            ) in str(refused.value)


def test_a_shard_reference_that_is_not_a_path_is_refused(sharded: Path, tmp_path: Path) -> None:
    index_file, index, _ = _copy(sharded, tmp_path / "save")
    index["model"]["encoder.embed_tokens.weight"] = {"__shard__": [1]}
    torch.save(index, index_file)
    words = "refers to a tensor by a list, not by its path"
    with pytest.raises(ShardedCheckpointError, match=words):
        read_shard_metadata(index_file, index)
    _refused_everywhere(index_file, words, tmp_path)


def test_planner_data_sharing_lists_is_refused_at_once(sharded: Path, tmp_path: Path) -> None:
    index_file, index, directory = _copy(sharded, tmp_path / "save")
    _without_checksums(index_file, index)
    metadata = SafeFileSystemReader(directory).read_metadata()
    metadata.planner_data = _shared_lists(31)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeMetadataError, match="holds planner data or a version of "
                       "unexpected types"):
        SafeFileSystemReader(directory).read_metadata()
    verdict = verify.check(index_file)
    assert not verdict.intact and "planner data" in verdict.line and "\n" not in verdict.line


def test_genuine_planner_data_with_a_shared_list_still_loads(
    sharded: Path, tmp_path: Path
) -> None:
    _, _, directory = _copy(sharded, tmp_path / "save")
    metadata = SafeFileSystemReader(directory).read_metadata()
    shared = ["model", "w"]
    metadata.planner_data = {"model/w": shared, "again": shared}
    with open(directory / ".metadata", "wb") as stream:
        pickle.dump(metadata, stream)
    with open(directory / ".metadata", "rb") as stream:
        assert load_metadata(stream, "genuine").planner_data == {"model/w": shared,
                                                                 "again": shared}


def test_a_fifo_in_place_of_the_metadata_is_refused_without_blocking(
    sharded: Path, tmp_path: Path
) -> None:
    index_file, index, directory = _copy(sharded, tmp_path / "save")
    _without_checksums(index_file, index)
    (directory / ".metadata").unlink()
    os.mkfifo(directory / ".metadata")
    with pytest.raises(ShardedCheckpointError) as refused:
        read_shard_metadata(index_file, index)
    assert "is a FIFO, not the regular file DCP writes" in str(refused.value)
    verdict = verify.check(index_file)
    assert not verdict.intact and "is a FIFO" in verdict.line and "\n" not in verdict.line


def test_a_metadata_symlink_out_of_its_directory_is_refused(
    sharded: Path, tmp_path: Path
) -> None:
    index_file, index, directory = _copy(sharded, tmp_path / "save")
    _without_checksums(index_file, index)
    outside = tmp_path / "outside.metadata"
    shutil.move(directory / ".metadata", outside)
    (directory / ".metadata").symlink_to(outside)
    with pytest.raises(ShardedCheckpointError, match="outside its shard directory"):
        read_shard_metadata(index_file, index)


def _chunk_holding(directory: Path, fqn: str, payload: bytes) -> Path:
    """Append ``payload`` to the shard file of ``fqn``'s chunk and point the chunk at it."""
    metadata = SafeFileSystemReader(directory).read_metadata()
    info = next(info for key, info in metadata.storage_data.items() if key.fqn == fqn)
    shard_file = directory / info.relative_path
    info.offset, info.length = shard_file.stat().st_size, len(payload)
    with open(shard_file, "ab") as stream:
        stream.write(payload)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    return shard_file


class _RunsCommand:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, ("true",)


def test_a_chunk_holding_a_refused_pickle_is_named_in_one_line(
    sharded: Path, tmp_path: Path
) -> None:
    """Not torch's advice to load it with weights_only=False, nor a line of torch's source."""
    index_file, index, directory = _copy(sharded, tmp_path / "save")
    _without_checksums(index_file, index)
    payload = io.BytesIO()
    torch.save(_RunsCommand(), payload)
    shard_file = _chunk_holding(directory, "model/encoder.version", payload.getvalue())
    entries = read_shard_metadata(index_file, index)
    for load in (lambda: full_tensors(index_file, index),  # fairseq-generate's gather
                 lambda: load_tensors(index_file, index,  # resume's collective load
                                      {path: torch.empty(tuple(entries[path].size),
                                                         dtype=entries[path].properties.dtype)
                                       for path in tensor_paths(index)})):
        with pytest.raises(ShardedCheckpointError) as refused:
            load()
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"{index_file}: {shard_file}: "), \
            message
        assert f"holds a pickled {os.system.__module__}.system, which the plugin does not " \
            "load" in message, message
        assert "weights_only` set to `False" not in message and "raise " not in message
    # fairseq-shard-consolidate streams the chunk instead: the same line, not torch's advice
    with pytest.raises(consolidate.ConsolidateError) as refused:
        consolidate.export_consolidated(index_file, tmp_path / "model.pt")
    assert f"{shard_file}: its chunk at byte " in str(refused.value)
    assert "weights_only` set to `False" not in str(refused.value)


def test_a_file_the_weights_only_reader_refuses_names_its_reason_not_torchs_advice(
    tmp_path: Path
) -> None:
    """An opcode torch's weights_only reader does not take: the first line of torch's message
    is its advice to load the file with weights_only=False."""
    from fairseq_shard_plugin.checkpoint.errors import describe_unreadable
    from fairseq_shard_plugin.checkpoint.reading import read_checkpoint

    saved = io.BytesIO()
    torch.save({"a": 1}, saved)
    path = tmp_path / "checkpoint_last.pt"
    with zipfile.ZipFile(saved) as source, zipfile.ZipFile(path, "w") as target:
        for entry in source.infolist():
            data = source.read(entry.filename)
            if entry.filename.endswith("data.pkl"):
                data = data.replace(b"K\x01s.", b"K\x01\x8e\x00\x00\x00\x00s.")
            target.writestr(entry, data)
    with pytest.raises(Exception) as failed:
        read_checkpoint(path)
    assert describe_unreadable(path, failed.value) == (
        f"{path}: refused by torch's weights_only=True reader (Unsupported operand 142), "
        "which the plugin never bypasses: a damaged or crafted file; re-save the checkpoint "
        "where it was written")
