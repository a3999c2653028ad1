"""Read torch.distributed.checkpoint's ``.metadata`` without running code from it.

DCP's ``FileSystemReader.read_metadata`` unpickles a checkpoint directory's ``.metadata``
with plain :mod:`pickle`, so a crafted sharded checkpoint would run arbitrary code as soon
as it is resumed from, read by fairseq-generate, consolidated or verified.
:class:`MetadataUnpickler` resolves only the globals that DCP's own metadata holds (its
metadata dataclasses, ``torch.Size``, torch's dtypes, layouts and memory formats, the
path it records as the checkpoint id) and refuses every other one by name, before anything
is called. :func:`load_metadata` also refuses what DCP would misuse later: shard file names
that leave the directory, and non-tensor entries, which DCP unpickles without restriction
on load (the plugin writes only tensors). :class:`SafeFileSystemReader` reads metadata so,
and is the ``storage_reader`` of every ``dcp.load`` of the plugin.
"""

from __future__ import annotations

import pathlib
import pickle
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.serialization
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
)

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


class UnsafeMetadataError(ShardPluginError, pickle.UnpicklingError):
    """A ``.metadata`` that holds what DCP's metadata never does; one line saying what."""


def _shown(text: str) -> str:
    """A name from the file, safe to print on one line."""
    return (text if text.isprintable() else repr(text))[:120]


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any global outside its allow-list is refused by name."""

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


def _plain_file_name(name: Any) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..")
            and "/" not in name and "\\" not in name and "\0" not in name)


def load_metadata(stream: IO[bytes], where: str | Path) -> Metadata:
    """The DCP metadata in ``stream`` (the file ``where``), or :class:`UnsafeMetadataError`."""
    metadata = MetadataUnpickler(stream, where).load()
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata,
                                                            dict):
        raise UnsafeMetadataError(f"{where}: holds a {type(metadata).__name__}, "
                                  "not DCP's metadata")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not _plain_file_name(name):
            raise UnsafeMetadataError(
                f"{where}: names the shard file {_shown(str(name))}, which is not a file "
                "of its directory (a crafted checkpoint?)")
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            raise UnsafeMetadataError(
                f"{where}: entry {_shown(str(fqn))} is a pickled object, not a tensor (the "
                "plugin writes only tensors; DCP would unpickle it unrestricted)")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file system reader, reading ``.metadata`` with :func:`load_metadata`; the
    last refusal is kept in ``refusal`` (``dcp.load`` reports it only as text)."""

    refusal: UnsafeMetadataError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # DCP asks for a rank's own __<rank>.metadata when there is no global one
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = load_metadata(stream, path)
            except UnsafeMetadataError as error:
                self.refusal = error
                raise
        # as torch's reader: a storage_meta (older files have none) carrying this load's id
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
