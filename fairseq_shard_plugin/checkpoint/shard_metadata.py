"""Read torch.distributed.checkpoint's ``.metadata`` without running code from it.

DCP's ``FileSystemReader.read_metadata`` unpickles a checkpoint directory's ``.metadata``
with plain :mod:`pickle`, so a crafted sharded checkpoint would run arbitrary code as soon
as it is resumed from, read by fairseq-generate, consolidated or verified.
:class:`MetadataUnpickler` resolves only the globals that DCP's own metadata holds (its
metadata dataclasses, ``torch.Size``, torch's dtypes, layouts and memory formats, the
path it records as the checkpoint id) and refuses every other one by name, before anything
is called. It is pickle's pure-Python unpickler, so that the opcodes that change existing
objects can be checked too: BUILD only fills in fresh instances of DCP's metadata classes
(a BUILD on an allowed *class* would change it for the rest of the process).
:func:`load_metadata` then checks every part by its exact type and refuses what DCP would
misuse later: shard file names that leave the directory, chunks whose claimed size exceeds
their stored bytes, and non-tensor entries, which DCP unpickles without restriction on load
(the plugin writes only tensors). :class:`SafeFileSystemReader` reads metadata so (from a
regular file of its directory only: a FIFO would block), checks that each shard file
resolves inside its directory, names the shard file and the refused type of a chunk that
fails to load, and is the ``storage_reader`` of every ``dcp.load`` of the plugin.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import pickle
import stat
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.serialization
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from fairseq_shard_plugin.checkpoint.reading import CheckpointStructureError, check_structure
from fairseq_shard_plugin.errors import ShardPluginError

METADATA_FILE = ".metadata"

_ALLOWED: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
       for name in ("Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata",
                    "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                    "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    # how torch pickles a torch.layout: this function only looks its name up among torch's
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    # StorageMeta.checkpoint_id, as dcp.save was given it (pathlib._local from Python 3.13)
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib._local", "PosixPath"): pathlib.PosixPath,
}
# torch.float32 and the like pickle as the attribute of the torch module they are
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
# The classes whose fresh instances BUILD may fill in (their dataclass fields only).
_BUILDABLE = frozenset({Metadata, StorageMeta, MetadataIndex, TensorStorageMetadata,
                        BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
                        _StorageInfo})


class UnsafeMetadataError(ShardPluginError, pickle.UnpicklingError):
    """A ``.metadata`` that holds what DCP's metadata never does; one line saying what."""


def _shown(text: str) -> str:
    """A name from the file, safe to print on one line."""
    return (text if text.isprintable() else repr(text))[:120]


def _refuse(where: str | Path, what: str) -> UnsafeMetadataError:
    return UnsafeMetadataError(f"{where}: {what}, which DCP's metadata never does (a crafted "
                               "checkpoint?); refused to unpickle it")


class MetadataUnpickler(pickle._Unpickler):  # the pure-Python one: its opcodes can be checked
    """Unpickles DCP metadata; any global outside its allow-list is refused by name.

    Opcodes that change an existing object act only on objects of the exact types DCP's
    metadata builds them on: BUILD (set attributes) on fresh instances of DCP's metadata
    classes, with their own fields only, never on a class, an enum member or a path (a
    change to a class would outlive this file); SETITEM(S) on dicts, APPEND(S) on lists."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, stream: IO[bytes], where: str | Path) -> None:
        super().__init__(stream)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch" and "." not in name:
            value = getattr(torch, name, None)
            if isinstance(value, _TORCH_VALUES):
                return value
        raise UnsafeMetadataError(
            f"{self.where}: refers to {_shown(module)}.{_shown(name)}, which DCP's metadata "
            "never holds (a crafted checkpoint?); refused to unpickle it")

    def _target(self, depth: int, kind: type, opcode: str) -> None:
        target = self.stack[-depth] if len(self.stack) >= depth else None
        if type(target) is not kind:
            raise _refuse(self.where, f"{opcode} on a {type(target).__name__}")

    def load_build(self) -> None:
        state, instance = self.stack[-1], self.stack[-2]
        cls = type(instance)
        if cls not in _BUILDABLE:
            shown = instance.__name__ if isinstance(instance, type) else cls.__name__
            raise _refuse(self.where, f"sets attributes of {_shown(shown)}")
        if cls is TensorProperties:  # its own __setstate__ takes a 5-tuple
            if type(state) is not tuple or len(state) != 5:
                raise _refuse(self.where, "gives TensorProperties an unexpected state")
            self.stack.pop()
            TensorProperties.__setstate__(instance, state)
            return
        names = {f.name for f in dataclasses.fields(cls)}
        if type(state) is not dict or not all(type(k) is str and k in names for k in state):
            raise _refuse(self.where, f"sets attributes {cls.__name__} does not have")
        self.stack.pop()
        instance.__dict__.update(state)

    def load_setitem(self) -> None:
        self._target(3, dict, "SETITEM")
        super().load_setitem()

    def load_setitems(self) -> None:
        items = self.pop_mark()
        if type(self.stack[-1]) is not dict:
            raise _refuse(self.where, f"SETITEMS on a {type(self.stack[-1]).__name__}")
        for i in range(0, len(items), 2):
            self.stack[-1][items[i]] = items[i + 1]

    def load_append(self) -> None:
        self._target(2, list, "APPEND")
        super().load_append()

    def load_appends(self) -> None:
        items = self.pop_mark()
        if type(self.stack[-1]) is not list:
            raise _refuse(self.where, f"APPENDS on a {type(self.stack[-1]).__name__}")
        self.stack[-1].extend(items)

    def load_additems(self) -> None:
        raise _refuse(self.where, "builds a set")

    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.APPEND[0]] = load_append
    dispatch[pickle.APPENDS[0]] = load_appends
    dispatch[pickle.ADDITEMS[0]] = load_additems


def _plain_file_name(name: Any) -> bool:
    return (type(name) is str and name not in ("", ".", "..")
            and "/" not in name and "\\" not in name and "\0" not in name)


def _is_size(value: Any) -> bool:
    return type(value) is torch.Size and all(type(n) is int and n >= 0 for n in value)


# the planner's data: DCP writes a few entries per tensor, nested a few deep
_PLAIN_DEPTH = 32
_PLAIN_ENTRIES = 10_000_000


def _plain_parts(value: Any) -> Any:
    """What a container of plain data holds; None for a plain value (a string, an int, a
    bool, None); anything else is refused."""
    if value is None or type(value) in (str, int, bool):
        return None
    if type(value) is dict:
        return (*value.keys(), *value.values())
    if type(value) in (list, tuple):
        return value
    raise CheckpointStructureError(f"a {type(value).__name__}")


def _plain_data(value: Any) -> bool:
    """Nested dicts, lists and tuples of strings, ints, bools and None (the planner's data),
    no container deeper than ``_PLAIN_DEPTH``, at most ``_PLAIN_ENTRIES`` entries counted
    along every path (:func:`..reading.check_structure`: each container measured once)."""
    try:
        check_structure(value, _plain_parts, _PLAIN_DEPTH + 1, _PLAIN_ENTRIES)
    except CheckpointStructureError:
        return False
    return True


def _check_storage_info(where: str | Path, key: Any, info: Any) -> None:
    if type(key) is not MetadataIndex or type(key.fqn) is not str or not (
            key.offset is None or _is_size(key.offset)):
        raise _refuse(where, f"indexes its storage by a {type(key).__name__}")
    if type(info) is not _StorageInfo:
        raise _refuse(where, f"describes the storage of {_shown(key.fqn)} by a "
                             f"{type(info).__name__}")
    if not _plain_file_name(info.relative_path):
        raise UnsafeMetadataError(
            f"{where}: names the shard file {_shown(str(info.relative_path))}, which is not a "
            "file of its directory (a crafted checkpoint?)")
    if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 \
            or info.length < 0:
        raise _refuse(where, f"gives {_shown(key.fqn)} a storage offset or length that is "
                             "not a count of bytes")
    if info.transform_descriptors not in (None, [], ()):
        raise _refuse(where, f"asks for transforms of {_shown(key.fqn)}'s bytes")


def _chunk_inside(chunk: Any, size: torch.Size) -> bool:
    if type(chunk) is not ChunkStorageMetadata or not _is_size(chunk.offsets) \
            or not _is_size(chunk.sizes) or not len(chunk.offsets) == len(chunk.sizes) == len(size):
        return False
    return all(o + n <= s for o, n, s in zip(chunk.offsets, chunk.sizes, size, strict=True))


def _tiling_problem(chunks: list[Any], size: torch.Size) -> str | None:
    """What keeps ``chunks`` (each inside a tensor of ``size``) from tiling it as the
    plugin's shards do (FSDP2's ``Shard(0)``: slices of the first dimension, whole in the
    others, one after another), or None. Linear after a sort, whatever a crafted file
    holds; chunks without elements count for nothing."""
    if not size:  # a scalar: one chunk
        return None if len(chunks) == 1 else "more than one chunk for a scalar"
    spans = []
    for chunk in chunks:
        if not math.prod(chunk.sizes):
            continue
        if any(chunk.offsets[1:]) or tuple(chunk.sizes[1:]) != tuple(size[1:]):
            return "a chunk split along a dimension other than the first"
        spans.append((chunk.offsets[0], chunk.sizes[0]))
    end = 0
    for start, rows in sorted(spans):
        if start < end:  # as many elements may still add up: some never read
            return "overlapping chunks"
        if start > end:
            return "chunks that do not cover its shape"
        end = start + rows
    return None if end == size[0] or not math.prod(size) else (
        "chunks that do not cover its shape")


def _check_tensor_entry(where: str | Path, fqn: str, entry: Any, storage: dict) -> None:
    """A tensor's entry: exact types, chunks inside the tensor that tile it as the plugin's
    shards do, and each chunk's stored bytes at least as many as its elements need."""
    if type(entry) is not TensorStorageMetadata or type(entry.properties) is not \
            TensorProperties or type(entry.properties.dtype) is not torch.dtype \
            or not _is_size(entry.size) or type(entry.chunks) is not list:
        raise _refuse(where, f"describes {_shown(fqn)} by a {type(entry).__name__} of "
                             "unexpected parts")
    itemsize = torch.empty((), dtype=entry.properties.dtype).element_size()
    for chunk in entry.chunks:
        if not _chunk_inside(chunk, entry.size):
            raise _refuse(where, f"gives {_shown(fqn)} a chunk outside its shape")
        info = storage.get(MetadataIndex(fqn, chunk.offsets))
        if info is None:
            raise _refuse(where, f"stores no bytes for a chunk of {_shown(fqn)}")
        elements = math.prod(chunk.sizes)
        if info.length < elements * itemsize:
            raise UnsafeMetadataError(
                f"{where}: {_shown(fqn)} claims a chunk of {elements} elements "
                f"({elements * itemsize} bytes) stored in {info.length} bytes (a corrupted or "
                "crafted checkpoint)")
    problem = _tiling_problem(entry.chunks, entry.size)
    if problem:
        raise _refuse(where, f"gives {_shown(fqn)} {problem}")


def load_metadata(stream: IO[bytes], where: str | Path) -> Metadata:
    """The DCP metadata in ``stream`` (the file ``where``), or :class:`UnsafeMetadataError`.

    Beyond the unpickler's checks, every part must be of the exact type DCP writes (no
    other object can stand in for a dict or a storage entry), every shard file name a plain
    file name, every tensor's chunks covered by stored bytes; non-tensor entries (which DCP
    would unpickle unrestricted) are refused."""
    try:
        metadata = MetadataUnpickler(stream, where).load()
    except UnsafeMetadataError:
        raise
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError,
            IndexError, KeyError, RuntimeError) as error:
        raise UnsafeMetadataError(f"{where}: not DCP's metadata ({type(error).__name__}: "
                                  f"{_shown(str(error))})") from error
    if type(metadata) is not Metadata or type(metadata.state_dict_metadata) is not dict \
            or type(metadata.storage_data) is not dict:
        raise UnsafeMetadataError(f"{where}: holds a {type(metadata).__name__} of unexpected "
                                  "parts, not DCP's metadata")
    for key, info in metadata.storage_data.items():
        _check_storage_info(where, key, info)
    for fqn, entry in metadata.state_dict_metadata.items():
        if type(fqn) is not str:
            raise _refuse(where, f"names an entry by a {type(fqn).__name__}")
        if type(entry) is BytesStorageMetadata:
            raise UnsafeMetadataError(
                f"{where}: entry {_shown(fqn)} is a pickled object, not a tensor (the "
                "plugin writes only tensors; DCP would unpickle it unrestricted)")
        _check_tensor_entry(where, fqn, entry, metadata.storage_data)
    chunk_keys = {MetadataIndex(fqn, chunk.offsets)
                  for fqn, entry in metadata.state_dict_metadata.items() for chunk in entry.chunks}
    stray = next((key for key in metadata.storage_data if key not in chunk_keys), None)
    if stray is not None:  # bytes a reader placing blocks by their keys would put somewhere
        raise _refuse(where, f"stores bytes for {_shown(stray.fqn)} that no chunk names")
    meta = metadata.storage_meta
    if not (_plain_data(metadata.planner_data) and (metadata.version is None or type(
            metadata.version) is str) and (meta is None or type(meta) is StorageMeta)):
        raise _refuse(where, "holds planner data or a version of unexpected types")
    if meta is not None and not (
            (meta.checkpoint_id is None or type(meta.checkpoint_id) in (str, pathlib.PosixPath))
            and _plain_data(meta.save_id) and _plain_data(meta.load_id)
            and type(meta.modules) is list and _plain_data(meta.modules)):
        raise _refuse(where, "holds a storage record of unexpected types")
    return metadata


def resolves_outside(directory: Path, name: str) -> bool:
    """Whether file ``name`` of ``directory`` resolves to no file of it (a symlink out of
    it, say)."""
    return (directory / name).resolve().parent != directory.resolve()


def shard_files_outside(directory: Path, metadata: Metadata) -> list[str]:
    """The shard file names of ``metadata`` that :func:`resolves_outside` ``directory``."""
    names = {info.relative_path for info in metadata.storage_data.values()}
    return sorted(name for name in names if resolves_outside(directory, name))


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "an unknown kind of file")


def open_metadata_file(directory: Path, path: Path) -> IO[bytes]:
    """``path`` (a metadata file of ``directory``) opened for reading, or
    :class:`UnsafeMetadataError` for one that resolves outside ``directory`` or is no
    regular file (a FIFO would block the read forever: it is opened without blocking and
    checked before anything is read)."""
    if resolves_outside(directory, path.name):
        raise UnsafeMetadataError(
            f"{path}: resolves to {path.resolve()}, outside its shard directory (a symlink?); "
            "refused to read it: resume from an intact checkpoint")
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        raise UnsafeMetadataError(
            f"{path}: is {_file_kind(mode)}, not the regular file DCP writes; refused to "
            "read it: resume from an intact checkpoint")
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "rb")


def describe_chunk_failure(file: str | Path, offset: int, error: BaseException) -> str:
    """One line for a shard file's chunk (at byte ``offset``) that ``torch.load`` could not
    read: the pickled type it refused, by name (never torch's advice to load it with
    ``weights_only=False``), or the error's first line."""
    # errors imports integrity, which imports this module
    from fairseq_shard_plugin.checkpoint.errors import describe_unreadable

    if isinstance(error, pickle.UnpicklingError):
        line = describe_unreadable(file, error)
        if ": holds a pickled " in line:  # a type outside the allow-list, named
            return line.replace(": holds", f": its chunk at byte {offset} holds", 1)
        return (f"{file}: its chunk at byte {offset} is not a tensor torch.load reads with "
                "weights_only=True (a damaged or crafted shard file?)")
    lines = str(error).strip().splitlines()
    return (f"{file}: its chunk at byte {offset} could not be read "
            f"({type(error).__name__}: {lines[0][:200] if lines else ''})")


class ShardChunkError(ShardPluginError, RuntimeError):
    """A shard file's chunk that did not load; one line naming the file and the cause (it
    reaches the other ranks inside DCP's ``CheckpointException.failures``)."""


class SafeFileSystemReader(FileSystemReader):
    """DCP's file system reader, reading ``.metadata`` with :func:`load_metadata`; the
    last refusal is kept in ``refusal`` (``dcp.load`` reports it only as text). A chunk
    that fails to load raises :class:`ShardChunkError`, naming its file."""

    refusal: UnsafeMetadataError | None = None
    _chunk: tuple[Path, int] | None = None  # the chunk read last: its file, its offset

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # DCP asks for a rank's own __<rank>.metadata when there is no global one
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        path = Path(self.path, name)
        try:
            opened = open_metadata_file(Path(self.path), path)
        except UnsafeMetadataError as error:
            self.refusal = error
            raise
        with opened as stream:
            try:
                metadata = load_metadata(stream, path)
                outside = shard_files_outside(Path(self.path), metadata)
                if outside:
                    raise UnsafeMetadataError(
                        f"{path}: its shard file {_shown(outside[0])} resolves to "
                        f"{Path(self.path, outside[0]).resolve()}, outside its directory "
                        "(a symlink?)")
            except UnsafeMetadataError as error:
                self.refusal = error
                raise
        # as torch's reader: a storage_meta (older files have none) carrying this load's id
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        self._chunk = (Path(self.path, sinfo.relative_path), sinfo.offset)
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().read_data(plan, planner)
        except ShardPluginError:
            raise
        except Exception as error:
            if self._chunk is None:
                raise
            raise ShardChunkError(describe_chunk_failure(*self._chunk, error)) from error
