"""A crafted sharded checkpoint runs no code and reads nothing outside its save dir.

DCP's ``.metadata`` is a pickle: the plugin unpickles it only through an allow-list
(``shard_metadata``), on every path that reads one (resume's metadata read and
``dcp.load``, the one-process gather of fairseq-generate and fairseq-shard-consolidate,
fairseq-shard-verify). An index's shard directory must be one of ``checkpoint_shards/``
beside it. The checkpoint here is a real one: written by ``save_sharded`` in a one-rank
gloo group (a DTensor and plain tensors of several dtypes), then altered per test.
"""

from __future__ import annotations

import builtins
import io
import os
import pathlib
import pickle
import shlex
import shutil
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fairseq_shard_plugin.checkpoint import consolidate, verify
from fairseq_shard_plugin.checkpoint.shard_metadata import (
    MetadataUnpickler,
    SafeFileSystemReader,
    UnsafeMetadataError,
)
from fairseq_shard_plugin.checkpoint.sharded import (
    SHARDED_KEY,
    SHARDS_DIR,
    ShardedCheckpointError,
    full_tensors,
    load_tensors,
    mark_as_shard_directory,
    read_shard_metadata,
    save_sharded,
    shard_directory,
)
from fairseq_shard_plugin.cli import consolidate as cli_consolidate
from fairseq_shard_plugin.cli import verify as cli_verify
from launching.harness import run_command

from tiny_training import one_rank_group

INDEX = "checkpoint_last.pt"


class _Genuine:
    """A save dir holding one genuine sharded checkpoint, and the tensors saved in it."""

    def __init__(self, save_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
        self.save_dir = save_dir
        self.tensors = tensors

    def copy(self, destination: Path) -> tuple[Path, dict[str, Any], Path]:
        """A copy of the save dir: its index file, the index and its shard directory."""
        shutil.copytree(self.save_dir, destination)
        index_file = destination / INDEX
        index = torch.load(index_file, weights_only=True)
        return index_file, index, destination / index[SHARDED_KEY]["dir"]


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Genuine]:
    """Saved in a one-rank gloo group, which stays up for the module's collective loads."""
    root = tmp_path_factory.mktemp("sharded_security")
    with one_rank_group(root):
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(6, 4, generator=generator)
        state = {
            "model": {"w": distribute_tensor(weight, mesh, [Shard(0)]),
                      "b": torch.randn(4, generator=generator).to(torch.bfloat16),
                      "steps": torch.arange(5)},
            "last_optimizer_state": {
                "state": {0: {"exp_avg": torch.ones(3, dtype=torch.float16)}}},
            "cfg": {"name": "tiny"},
        }
        save_dir = root / "save"
        index = save_sharded(state, save_dir, num_updates=7)
        torch.save(index, save_dir / INDEX)
        tensors = {"model/w": weight, "model/b": state["model"]["b"],
                   "model/steps": state["model"]["steps"],
                   "last_optimizer_state/state/0/exp_avg":
                       state["last_optimizer_state"]["state"][0]["exp_avg"]}
        yield _Genuine(save_dir, tensors)


# ---------------------------------------------------------------- genuine checkpoints load


def test_genuine_metadata_reads_as_torch_reads_it(genuine: _Genuine, tmp_path: Path) -> None:
    index_file, index, directory = genuine.copy(tmp_path / "save")
    reader = SafeFileSystemReader(directory)
    ours, torchs = reader.read_metadata(), FileSystemReader(directory).read_metadata()
    assert ours.state_dict_metadata == torchs.state_dict_metadata
    assert ours.storage_data == torchs.storage_data
    assert ours.planner_data == torchs.planner_data
    assert ours.version == torchs.version
    assert ours.storage_meta.checkpoint_id == torchs.storage_meta.checkpoint_id
    assert ours.storage_meta.save_id == torchs.storage_meta.save_id
    assert ours.storage_meta.load_id == reader.load_id
    assert read_shard_metadata(index_file, index) == torchs.state_dict_metadata


def test_the_allow_list_admits_every_global_torch_writes(
    genuine: _Genuine, tmp_path: Path
) -> None:
    """What a real .metadata refers to (torch 2.13 pickles dtypes as attributes of the
    torch module, layouts through torch.serialization._get_layout, memory formats as DCP's
    own enum), and the other dtypes, layouts and memory formats tensor properties may hold."""
    _, _, directory = genuine.copy(tmp_path / "save")
    found: set[tuple[str, str]] = set()

    class Recording(MetadataUnpickler):
        def find_class(self, module: str, name: str) -> Any:
            found.add((module, name))
            return super().find_class(module, name)

    with open(directory / ".metadata", "rb") as stream:
        assert isinstance(Recording(stream, "genuine").load(), Metadata)
    assert {("torch", "float32"), ("torch", "bfloat16"), ("torch", "int64"), ("torch", "Size"),
            ("torch.serialization", "_get_layout"),
            ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo")} <= found
    properties = TensorProperties(dtype=torch.complex64, layout=torch.sparse_coo,
                                  memory_format=torch.channels_last)
    again = MetadataUnpickler(io.BytesIO(pickle.dumps(properties)), "probe").load()
    assert (again.dtype, again.layout, again.memory_format) == (
        torch.complex64, torch.sparse_coo, torch.channels_last)


def test_genuine_shards_load_on_every_path(genuine: _Genuine, tmp_path: Path) -> None:
    index_file, index, _ = genuine.copy(tmp_path / "save")
    gathered = full_tensors(index_file, index)  # fairseq-generate's and consolidate's gather
    assert gathered.keys() == genuine.tensors.keys()
    for path, tensor in genuine.tensors.items():
        assert torch.equal(gathered[path], tensor), path
    # resume's collective load, into a DTensor sharded on the group
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    targets: dict[str, torch.Tensor] = {
        path: torch.empty_like(tensor) for path, tensor in genuine.tensors.items()}
    targets["model/w"] = distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)])
    read_shard_metadata(index_file, index, collective=True)
    load_tensors(index_file, index, targets)
    assert isinstance(targets["model/w"], DTensor)
    assert torch.equal(targets["model/w"].full_tensor(), genuine.tensors["model/w"])
    assert torch.equal(targets["model/b"], genuine.tensors["model/b"])
    assert verify.check(index_file).intact


# ---------------------------------------------------------------- crafted .metadata


class _WritesMarker:
    """Unpickles by calling ``call`` (a function that runs code) to create ``marker``."""

    def __init__(self, call: Callable[[str], Any], marker: Path) -> None:
        self.call, self.marker = call, marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        if self.call is os.system:
            return os.system, (f"touch {shlex.quote(str(self.marker))}",)
        return self.call, (f"open({str(self.marker)!r}, 'w').write('ran')",)


PAYLOADS = {  # the function a crafted .metadata calls, and the global the refusal names
    "os.system": (os.system, f"{os.system.__module__}.system"),
    "builtins.eval": (builtins.eval, "builtins.eval"),
    "builtins.exec": (builtins.exec, "builtins.exec"),
}


def _crafted(directory: Path, call: Callable[[str], Any], marker: Path,
             name: str = ".metadata") -> None:
    """Replace the directory's metadata by the genuine one with a payload among its entries
    (the refusal comes after DCP's own classes were admitted); check the payload is live."""
    metadata = SafeFileSystemReader(directory).read_metadata()
    metadata.state_dict_metadata["model/w"] = _WritesMarker(call, marker)  # type: ignore
    crafted = pickle.dumps(metadata)
    pickle.loads(crafted)  # what torch's own reader does with it: the code runs
    assert marker.exists()
    marker.unlink()
    (directory / name).write_bytes(crafted)


def _one_line_refusal(message: str, index_file: Path, refused: str) -> None:
    assert "\n" not in message, message
    assert message.startswith(f"{index_file}: "), message
    assert f"refers to {refused}, which DCP's metadata never holds" in message, message


@pytest.mark.parametrize("payload", PAYLOADS)
def test_crafted_metadata_is_refused_on_every_read_path(
    genuine: _Genuine, tmp_path: Path, payload: str, capsys: pytest.CaptureFixture[str]
) -> None:
    call, refused = PAYLOADS[payload]
    index_file, index, directory = genuine.copy(tmp_path / "save")
    marker = tmp_path / "marker"
    _crafted(directory, call, marker)

    with pytest.raises(UnsafeMetadataError, match=f"refers to {refused},"):
        SafeFileSystemReader(directory).read_metadata()
    for read in (lambda: read_shard_metadata(index_file, index, collective=True),  # resume
                 lambda: load_tensors(index_file, index,  # resume's dcp.load
                                      {p: torch.empty_like(t)
                                       for p, t in genuine.tensors.items()}),
                 lambda: full_tensors(index_file, index)):  # fairseq-generate, consolidate
        with pytest.raises(ShardedCheckpointError) as error:
            read()
        _one_line_refusal(str(error.value), index_file, refused)

    verdict = verify.check(index_file)
    assert not verdict.intact
    _one_line_refusal(verdict.line, index_file, refused)
    with pytest.raises(SystemExit) as stopped:
        cli_verify.main([str(index_file.parent)])
    assert stopped.value.code == 1
    _one_line_refusal(capsys.readouterr().out.splitlines()[0], index_file, refused)

    out = tmp_path / "model.pt"
    with pytest.raises(SystemExit) as stopped:
        cli_consolidate.main([str(index_file.parent), str(out)])
    message = str(stopped.value.code)
    assert message.startswith("fairseq-shard-consolidate: error: "), message
    _one_line_refusal(message.removeprefix("fairseq-shard-consolidate: error: "), index_file,
                      refused)
    assert not out.exists()
    assert not marker.exists()


@pytest.mark.e2e
def test_the_verify_command_refuses_crafted_metadata(genuine: _Genuine, tmp_path: Path) -> None:
    """The installed fairseq-shard-verify, as a user runs it."""
    command = Path(sys.executable).parent / "fairseq-shard-verify"
    if not command.exists():
        pytest.skip("fairseq-shard-verify is not installed beside this python")
    index_file, _, directory = genuine.copy(tmp_path / "save")
    marker = tmp_path / "marker"
    _crafted(directory, os.system, marker)
    done = run_command([str(command), str(index_file)])
    assert done.returncode == 1, done.stderr
    _one_line_refusal(done.stdout.splitlines()[0], index_file, PAYLOADS["os.system"][1])
    assert not marker.exists()


def test_dcp_falling_back_to_rank_metadata_refuses_it_too(
    genuine: _Genuine, tmp_path: Path
) -> None:
    """Without a .metadata, dcp.load reads the rank's own __0.metadata: through the same
    allow-list."""
    index_file, index, directory = genuine.copy(tmp_path / "save")
    marker = tmp_path / "marker"
    _crafted(directory, builtins.exec, marker, name=f"__{dist.get_rank()}.metadata")
    (directory / ".metadata").unlink()
    with pytest.raises(ShardedCheckpointError) as error:
        load_tensors(index_file, index, {p: torch.empty_like(t)
                                         for p, t in genuine.tensors.items()})
    _one_line_refusal(str(error.value), index_file, "builtins.exec")
    assert not marker.exists()


def test_globals_of_the_torch_module_are_admitted_only_as_dtypes_and_the_like() -> None:
    # GLOBAL torch.load, called with "x": torch.load is an attribute of the torch module
    crafted = b"\x80\x02ctorch\nload\nX\x01\x00\x00\x00x\x85R."
    with pytest.raises(UnsafeMetadataError, match=r"refers to torch\.load, "):
        MetadataUnpickler(io.BytesIO(crafted), "crafted").load()
    unpickler = MetadataUnpickler(io.BytesIO(b""), "probe")
    assert unpickler.find_class("torch", "bfloat16") is torch.bfloat16
    for module, name in (("torch", "_C"), ("torch", "float32.__class__"),
                         ("torch.distributed.checkpoint.metadata", "torch"),
                         ("pathlib", "Path"), ("collections", "OrderedDict")):
        with pytest.raises(UnsafeMetadataError):
            unpickler.find_class(module, name)


def test_shard_files_outside_the_directory_are_refused(genuine: _Genuine, tmp_path: Path) -> None:
    index_file, index, directory = genuine.copy(tmp_path / "save")
    metadata = SafeFileSystemReader(directory).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "../../outside.distcp"
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ShardedCheckpointError) as error:
        read_shard_metadata(index_file, index)
    assert "names the shard file ../../outside.distcp, which is not a file of its directory" \
        in str(error.value)
    assert "\n" not in str(error.value)


def test_non_tensor_entries_are_refused(genuine: _Genuine, tmp_path: Path) -> None:
    """DCP would unpickle such an entry's bytes with weights_only=False."""
    index_file, index, directory = genuine.copy(tmp_path / "save")
    metadata: Metadata = SafeFileSystemReader(directory).read_metadata()
    metadata.state_dict_metadata["model/w"] = BytesStorageMetadata()
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ShardedCheckpointError, match="entry model/w is a pickled object, not "
                       "a tensor"):
        full_tensors(index_file, index)


def test_checksums_naming_files_outside_the_directory_are_refused(
    genuine: _Genuine, tmp_path: Path
) -> None:
    index_file, index, _ = genuine.copy(tmp_path / "save")
    index[SHARDED_KEY]["crc32"]["../../outside"] = 0
    with pytest.raises(ShardedCheckpointError, match="its checksums name '../../outside', not "
                       "a file of its shard directory"):
        read_shard_metadata(index_file, index)


# ---------------------------------------------------------------- the index's "dir"


@pytest.mark.parametrize("where", ["parent", "absolute", "climbing", "shards_dir", "nested",
                                   "symlink"])
def test_shard_directories_outside_checkpoint_shards_are_refused(
    genuine: _Genuine, tmp_path: Path, where: str
) -> None:
    """Each names a genuine copy of the shards: only its place is wrong."""
    index_file, index, directory = genuine.copy(tmp_path / "save")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(directory, elsewhere)
    shards = index_file.parent / SHARDS_DIR
    relative = {
        "parent": "../elsewhere",
        "absolute": str(elsewhere),
        "climbing": f"{SHARDS_DIR}/{directory.name}/../../../elsewhere",
        "shards_dir": SHARDS_DIR,
        "nested": f"{SHARDS_DIR}/{directory.name}/inner",
        "symlink": f"{SHARDS_DIR}/link",
    }[where]
    if where == "nested":
        shutil.copytree(elsewhere, directory / "inner")
    if where == "symlink":
        (shards / "link").symlink_to(elsewhere, target_is_directory=True)
    index[SHARDED_KEY]["dir"] = relative
    torch.save(index, index_file)

    for read in (lambda: shard_directory(index_file, index),
                 lambda: read_shard_metadata(index_file, index),
                 lambda: full_tensors(index_file, index)):
        with pytest.raises(ShardedCheckpointError) as error:
            read()
        message = str(error.value)
        assert "\n" not in message
        assert message.startswith(f"{index_file}: refusing its shard directory {relative}: "
                                  "it resolves to "), message
        assert message.endswith(f", not to a directory of {shards.resolve()}"), message
    verdict = verify.check(index_file)
    assert not verdict.intact and "refusing its shard directory" in verdict.line
    with pytest.raises(consolidate.ConsolidateError, match="refusing its shard directory"):
        consolidate.read_full_state(index_file)


@pytest.mark.parametrize("entry", [{}, {"dir": 3}, {"dir": ""}, "checkpoint_shards/x"])
def test_an_index_without_a_directory_name_is_refused(
    genuine: _Genuine, tmp_path: Path, entry: Any
) -> None:
    index_file, index, _ = genuine.copy(tmp_path / "save")
    index[SHARDED_KEY] = entry
    with pytest.raises(ShardedCheckpointError, match="entry names no shard directory"):
        shard_directory(index_file, index)


def test_an_absolute_path_to_its_own_shards_is_accepted(
    genuine: _Genuine, tmp_path: Path
) -> None:
    """The rule is where the directory is, not how it is written."""
    index_file, index, directory = genuine.copy(tmp_path / "save")
    index[SHARDED_KEY]["dir"] = str(directory)
    assert shard_directory(index_file, index) == directory.resolve()
    assert torch.equal(full_tensors(index_file, index)["model/w"], genuine.tensors["model/w"])


# ---------------------------------------------------------------- opcodes that change objects

# Each sets an attribute "armed" on something the allow-list admits, which stock pickle does:
# a class or an enum member (BUILD with slot state), or a class's namespace (SETITEM).
MUTATIONS = {
    "build-on-a-class": b"\x80\x02cpathlib\nPosixPath\nN}X\x05\x00\x00\x00armedK\x01s\x86b.",
    "build-on-an-enum-member": b"\x80\x02ctorch.distributed.checkpoint.metadata\n"
                               b"_MEM_FORMAT_ENCODING\nK\x00\x85RN}X\x05\x00\x00\x00armedK\x01s"
                               b"\x86b.",
    "setitem-on-a-class": b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n"
                          b"X\x05\x00\x00\x00armedK\x01s.",
}


@pytest.mark.parametrize("crafted", MUTATIONS.values(), ids=MUTATIONS.keys())
def test_opcodes_that_would_change_an_allowed_class_are_refused(crafted: bytes) -> None:
    touched = (pathlib.PosixPath, Metadata, _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT)
    with pytest.raises(UnsafeMetadataError, match="which DCP's metadata never does"):
        MetadataUnpickler(io.BytesIO(crafted), "crafted").load()
    assert not any(hasattr(thing, "armed") for thing in touched)


def test_a_metadata_file_that_builds_on_a_class_changes_nothing_for_the_next_command(
    genuine: _Genuine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The attack on fairseq-shard-consolidate: a first read arming a class for a second."""
    index_file, _, directory = genuine.copy(tmp_path / "save")
    (directory / ".metadata").write_bytes(MUTATIONS["build-on-a-class"])
    out = tmp_path / "out" / "model.pt"
    for _ in range(2):
        with pytest.raises(SystemExit) as stopped:
            cli_consolidate.main([str(index_file.parent), str(out)])
        message = str(stopped.value.code)
        assert "sets attributes of PosixPath" in message and "\n" not in message, message
    assert not hasattr(pathlib.PosixPath, "armed")
    assert not out.parent.exists()


def test_storage_data_of_another_type_is_refused(genuine: _Genuine, tmp_path: Path) -> None:
    """DCP looks chunks up in storage_data by index: only a real dict, all of whose entries
    were checked, may stand there."""
    index_file, index, directory = genuine.copy(tmp_path / "save")
    metadata = SafeFileSystemReader(directory).read_metadata()
    metadata.storage_data = list(metadata.storage_data.values())
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ShardedCheckpointError, match="of unexpected parts, not DCP's metadata"):
        full_tensors(index_file, index)
    assert not verify.check(index_file).intact


def test_a_shard_file_symlinked_out_of_its_directory_is_refused(
    genuine: _Genuine, tmp_path: Path
) -> None:
    index_file, index, directory = genuine.copy(tmp_path / "save")
    shard = next(directory.glob("*.distcp"))
    outside = tmp_path / "outside.distcp"
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    for read in (lambda: read_shard_metadata(index_file, index),
                 lambda: full_tensors(index_file, index)):
        with pytest.raises(ShardedCheckpointError, match="outside its directory") as error:
            read()
        assert "\n" not in str(error.value)
    verdict = verify.check(index_file)
    assert not verdict.intact and "outside its directory" in verdict.line, verdict.line


def test_a_save_dir_copied_with_its_shards_link_is_told_whose_shards_it_reads(
    genuine: _Genuine, tmp_path: Path
) -> None:
    """``cp -a`` of a save dir whose checkpoint_shards is a link to a scratch disk copies
    the link: the copy's checkpoints read the original's shard directories, which the
    original's next save may remove (issue 32's audit). verify says so, on the copy only."""
    original = tmp_path / "original"
    index_file, index, directory = genuine.copy(original)
    mark_as_shard_directory(directory, original)  # as saved there
    scratch = tmp_path / "scratch"
    shutil.move(original / SHARDS_DIR, scratch)
    (original / SHARDS_DIR).symlink_to(scratch)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy, symlinks=True)  # cp -a
    assert verify.check(original / INDEX).line.endswith("epoch ?)")  # (no position saved)
    line = verify.check(copy / INDEX).line
    assert line == (f"{copy / INDEX}: ok (sharded, update ?, resumes in epoch ?; its shards are "
                           f"{original.resolve()}'s, whose runs remove the shard directories "
                           "their own checkpoints no longer name: copy them into this save "
                           "dir (cp -rL) to keep it)"), line
    shutil.rmtree(copy / SHARDS_DIR, ignore_errors=True)
    (copy / SHARDS_DIR).unlink(missing_ok=True)
    shutil.copytree(scratch, copy / SHARDS_DIR)  # cp -rL: the copy's own
    assert "its shards are" not in verify.check(copy / INDEX).line
    # moved, with a link left at the old name: still its own shards
    moved = tmp_path / "moved"
    original.rename(moved)
    original.symlink_to(moved)
    for save_dir in (moved, original):
        assert "its shards are" not in verify.check(save_dir / INDEX).line, save_dir


def test_a_tensor_claiming_more_elements_than_its_bytes_fails_verify(
    genuine: _Genuine, tmp_path: Path
) -> None:
    index_file, index, directory = genuine.copy(tmp_path / "save")
    metadata = SafeFileSystemReader(directory).read_metadata()
    entry = metadata.state_dict_metadata["model/w"]
    entry.size = entry.chunks[0].sizes = torch.Size([2**20, 2**20])
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    verdict = verify.check(index_file)
    assert not verdict.intact
    assert f"model/w claims a chunk of {2**40} elements" in verdict.line, verdict.line


def test_overlapping_chunks_that_add_up_to_the_shape_are_refused(
    genuine: _Genuine, tmp_path: Path
) -> None:
    """Chunks were checked to lie inside their tensor and to add up to its elements: two
    that overlap and add up left rows that no chunk fills (uninitialised memory in a load,
    zeros in an export), and verify said ok (issue 32's audit)."""
    index_file, index, directory = genuine.copy(tmp_path / "save")
    metadata = SafeFileSystemReader(directory).read_metadata()
    entry = metadata.state_dict_metadata["model/w"]  # 6 x 4, one chunk on one rank
    stored = metadata.storage_data[MetadataIndex("model/w", entry.chunks[0].offsets)]
    rows_0_to_2, rows_2_to_4 = (
        ChunkStorageMetadata(offsets=torch.Size([row, 0]), sizes=torch.Size([3, 4]))
        for row in (0, 2))  # 24 elements, and row 5 in neither
    entry.chunks = [rows_0_to_2, rows_2_to_4]
    metadata.storage_data[MetadataIndex("model/w", rows_2_to_4.offsets)] = stored
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    verdict = verify.check(index_file)
    assert not verdict.intact
    assert "gives model/w overlapping chunks" in verdict.line, verdict.line


def test_chunks_split_along_another_dimension_are_refused_in_linear_time(
    genuine: _Genuine, tmp_path: Path
) -> None:
    """The overlap check compared chunks pairwise along the first dimension: 20,000 column
    chunks of a [1, 20000] tensor, all spanning it, took minutes (issue 32's second audit).
    The plugin's shards are slices of the first dimension; anything else is refused."""
    index_file, index, directory = genuine.copy(tmp_path / "save")
    metadata = SafeFileSystemReader(directory).read_metadata()
    entry = metadata.state_dict_metadata["model/w"]
    stored = metadata.storage_data[MetadataIndex("model/w", entry.chunks[0].offsets)]
    columns = 20_000
    entry.size = torch.Size([1, columns])
    entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, column]),
                                         sizes=torch.Size([1, 1])) for column in range(columns)]
    for chunk in entry.chunks:
        metadata.storage_data[MetadataIndex("model/w", chunk.offsets)] = stored
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    started = time.monotonic()
    verdict = verify.check(index_file)
    assert time.monotonic() - started < 30  # (pairwise: minutes)
    assert not verdict.intact
    assert "gives model/w a chunk split along a dimension other than the first" in \
        verdict.line, verdict.line


def test_stored_blocks_are_read_only_as_the_chunks_they_are_named_for(
    genuine: _Genuine, tmp_path: Path
) -> None:
    """consolidate placed the blocks by their storage keys, each as long as its stored
    shape: a valid chunk list over swapped (or extra) storage entries exported another
    tensor, clipped and zero-filled, and verify said ok (the third audit). Extra keys are
    refused with the metadata; a block not of its chunk's shape, when it is read."""
    index_file, index, directory = genuine.copy(tmp_path / "save")
    metadata = SafeFileSystemReader(directory).read_metadata()
    entry = metadata.state_dict_metadata["model/w"]  # one 6 x 4 block
    stored = metadata.storage_data[MetadataIndex("model/w", entry.chunks[0].offsets)]
    metadata.storage_data[MetadataIndex("model/w", torch.Size([5, 0]))] = stored
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    verdict = verify.check(index_file)
    assert not verdict.intact and "stores bytes for model/w that no chunk names" in \
        verdict.line, verdict.line
    del metadata.storage_data[MetadataIndex("model/w", torch.Size([5, 0]))]
    entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([row, 0]), sizes=torch.Size([3, 4]))
                    for row in (0, 3)]  # two chunks, each named for the whole 6 x 4 block
    metadata.storage_data[MetadataIndex("model/w", torch.Size([3, 0]))] = stored
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    # and its checksum in the index, as a crafted index has it
    index[SHARDED_KEY]["crc32"][".metadata"] = zlib.crc32((directory / ".metadata").read_bytes())
    torch.save(index, index_file)
    with pytest.raises(consolidate.ConsolidateError,
                       match=r"its chunk of model/w at \[0, 0\] holds a \[6, 4\] torch.float32 "
                             r"block, not the chunk's \[3, 4\]"):
        consolidate.export_consolidated(index_file, tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists()


def test_a_changed_offset_in_the_metadata_fails_its_checksum(
    genuine: _Genuine, tmp_path: Path
) -> None:
    """.metadata has a CRC-32 in the index too: a chunk's offset changed to another place
    inside its file passes every structural check and would read the wrong bytes."""
    index_file, index, directory = genuine.copy(tmp_path / "save")
    assert ".metadata" in index[SHARDED_KEY]["crc32"]
    metadata = SafeFileSystemReader(directory).read_metadata()
    moved = next(item for item in metadata.storage_data.values() if item.offset > 0)
    moved.offset = 0
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    verdict = verify.check(index_file)
    assert not verdict.intact
    assert verdict.line == (f"{index_file}: corrupted checkpoint: {directory / '.metadata'} "
                            "fails its CRC-32 check (its bytes changed after it was saved); "
                            "resume from an intact checkpoint with --restore-file "
                            "(fairseq-shard-verify SAVE_DIR lists them)")
