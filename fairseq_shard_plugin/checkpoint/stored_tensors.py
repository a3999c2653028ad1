"""Tensors read straight from checkpoint files, a slab of rows at a time.

A full checkpoint (``torch.save``'s zip format) keeps each tensor's storage in one record at
a fixed offset in the file, and so does each chunk of a DCP shard file (a ``.distcp`` file
holds one ``torch.save`` zip per stored chunk). ``torch.load(..., map_location="meta")``
reads only the pickle and records each storage's offset in the file as
``_checkpoint_offset``; :class:`StoredBlock` keeps that place, and :class:`StreamedTensor`
assembles a tensor from its blocks when it is written: read straight into a fresh tensor
of the output dtype, or, to cast, ``SLAB_BYTES`` at a time. Nothing else of the
checkpoint is read: the peak is the tensor being built plus one slab. Both live in their
own anonymous mappings (:func:`mapped_empty`), given back to the system when freed: from
malloc, the freed blocks of hundreds of tensors of a few MiB stay in the heap, which then
grows by about the size of the model (measured: 180 MiB more for a 126 MiB model).
"""

from __future__ import annotations

import io
import mmap
import sys
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from fairseq_shard_plugin.checkpoint.atomic_files import describe_os_error
from fairseq_shard_plugin.checkpoint.shard_metadata import describe_chunk_failure
from fairseq_shard_plugin.checkpoint.streaming_writer import LazyTensor
from fairseq_shard_plugin.errors import ShardPluginError

SLAB_BYTES = 32 << 20


class StoredTensorError(ShardPluginError, ValueError):
    """A stored tensor that cannot be read; the message names the file and the problem."""


def mapped_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in an anonymous mapping of its own, unmapped when freed."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8, count=nbytes)
    return flat.view(dtype).view(shape)


@dataclass(frozen=True)
class StoredBlock:
    """Part of a tensor in a file: a storage whose bytes start at ``offset``, viewed as
    ``shape``/``stride`` from ``storage_offset`` (elements), whose first element lies at
    index ``start`` of the whole tensor."""

    file: Path
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    start: tuple[int, ...]


@dataclass(eq=False)
class StreamedTensor(LazyTensor):
    """A tensor of ``shape``, built as ``dtype`` from its stored ``blocks`` when written."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    blocks: tuple[StoredBlock, ...]

    def cast(self, dtype: torch.dtype | None) -> StreamedTensor:
        """This tensor as ``dtype`` if it is floating point and ``dtype`` is given."""
        if dtype is None or not self.dtype.is_floating_point:
            return self
        return replace(self, dtype=dtype)

    def materialize(self) -> torch.Tensor:
        out = mapped_empty(self.shape, self.dtype)
        for block in self.blocks:
            region = out[tuple(slice(first, first + size)
                               for first, size in zip(block.start, block.shape, strict=True))]
            try:
                _copy_block(block, region)
            except OSError as error:
                failure = f"could not read {block.file}: {describe_os_error(error)}"
            else:
                continue
            # raised outside the handler, so that it does not read as a failed write
            raise StoredTensorError(failure)
        return out


def _is_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def _read_exactly(stream: BinaryIO, buffer: torch.Tensor, file: Path) -> None:
    """Fill the uint8 tensor ``buffer`` from ``stream``."""
    view = memoryview(buffer.numpy())
    filled = 0
    while filled < len(view):
        got = stream.readinto(view[filled:])
        if not got:
            raise StoredTensorError(f"{file}: ends before the tensor data it should hold "
                                    "(truncated?)")
        filled += got


def _copy_block(block: StoredBlock, region: torch.Tensor) -> None:
    """Copy ``block`` into ``region`` (a view of its place in the output, any dtype)."""
    if region.numel() == 0:
        return
    item = block.dtype.itemsize
    with open(block.file, "rb", buffering=0) as stream:
        stream.seek(block.offset + block.storage_offset * item)
        if not _is_contiguous(block.shape, block.stride):  # a view: read what it spans
            span = 1 + sum((size - 1) * step for size, step in zip(block.shape, block.stride,
                                                                   strict=True))
            buffer = mapped_empty((span * item,), torch.uint8)
            _read_exactly(stream, buffer, block.file)
            region.copy_(buffer.view(block.dtype).as_strided(block.shape, block.stride))
            return
        if region.dtype == block.dtype and region.is_contiguous():  # straight into place
            _read_exactly(stream, region.reshape(-1).view(torch.uint8), block.file)
            return
        shape = block.shape or (1,)
        region = region.reshape(shape) if region.dim() == 0 else region
        row_bytes = item * (region.numel() // shape[0])
        rows_per_slab = max(1, SLAB_BYTES // row_bytes)
        buffer = mapped_empty((min(rows_per_slab, shape[0]) * row_bytes,), torch.uint8)
        for first in range(0, shape[0], rows_per_slab):
            rows = min(rows_per_slab, shape[0] - first)
            slab = buffer[: rows * row_bytes]
            _read_exactly(stream, slab, block.file)
            region.narrow(0, first, rows).copy_(slab.view(block.dtype).view(rows, *shape[1:]))


def stored_block(file: Path, tensor: torch.Tensor, base: int = 0,
                 start: tuple[int, ...] | None = None) -> StoredBlock:
    """Where the meta ``tensor`` of ``torch.load(file or a part of it at byte ``base``,
    map_location="meta")`` keeps its bytes."""
    offset = getattr(tensor.untyped_storage(), "_checkpoint_offset", None)
    if offset is None:
        raise StoredTensorError(f"{file}: torch did not say where a tensor's bytes lie")
    return StoredBlock(file, base + offset, tensor.dtype, tuple(tensor.shape),
                       tuple(tensor.stride()), tensor.storage_offset(),
                       start if start is not None else (0,) * tensor.dim())


def check_byte_order(source: str | BinaryIO, where: str | Path) -> None:
    """Refuse a zip whose tensors were written in the other byte order (read raw here)."""
    reader = torch._C.PyTorchFileReader(source)
    order = (reader.get_record("byteorder").decode() if reader.has_record("byteorder")
             else "little")  # torch.load's default for files without the record
    if order != sys.byteorder:
        raise StoredTensorError(f"{where}: its tensors are stored {order}-endian, this "
                                f"machine is {sys.byteorder}-endian; convert it with torch.load "
                                "and torch.save first")


def record_offsets(path: Path) -> frozenset[int]:
    """Where the bytes of each data record of the torch zip at ``path`` begin, read from
    the zip's own headers. ``torch.load(map_location="meta")`` reads the first record's
    place so and computes the others' from where torch's writer puts them: a zip re-packed
    by another tool has them elsewhere."""
    reader = torch._C.PyTorchFileReader(str(path))
    return frozenset(reader.get_record_offset(name) for name in reader.get_all_records()
                     if "/data/" in f"/{name}")


def check_stored_where_torch_says(block: StoredBlock, offsets: frozenset[int]) -> None:
    """Refuse a block whose place torch computed (see :func:`record_offsets`) but which no
    record of its file starts at: its bytes would be another record's."""
    if block.offset not in offsets:
        raise StoredTensorError(
            f"{block.file}: its tensors are not stored where torch.save puts them (re-packed "
            "by another zip tool?), so they cannot be read in place: save it again with "
            "torch.save(torch.load(FILE, weights_only=True), FILE2) and export that")


class _FileView(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open binary file, as a file of their own."""

    def __init__(self, stream: BinaryIO, start: int, length: int) -> None:
        super().__init__()
        self.stream, self.start, self.length, self.position = stream, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(0, base + offset)
        return self.position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = max(0, min(len(view), self.length - self.position))
        self.stream.seek(self.start + self.position)
        got = self.stream.readinto(view[:count]) or 0
        self.position += got
        return got


def _dcp_block(directory: Path, info: Any, start: tuple[int, ...]) -> StoredBlock:
    """The block of one chunk DCP stored (its ``_StorageInfo``): a ``torch.save`` zip."""
    file = directory / info.relative_path
    if getattr(info, "transform_descriptors", None):
        raise StoredTensorError(
            f"{file}: stored through DCP stream transforms ({', '.join(info.transform_descriptors)}"
            "), which fairseq-shard-consolidate does not read")
    try:
        stream = open(file, "rb")
    except OSError as error:  # removed meanwhile, say (a training's cleanup)
        raise StoredTensorError(f"could not read {file}: {describe_os_error(error)}") from error
    with stream:
        view = _FileView(stream, info.offset, info.length)
        try:
            tensor = torch.load(view, map_location="meta", weights_only=True)
        except Exception as error:  # noqa: BLE001 (a damaged chunk, in one line)
            raise StoredTensorError(describe_chunk_failure(file, info.offset, error)) from None
        if not isinstance(tensor, torch.Tensor):
            raise StoredTensorError(f"{file}: unreadable chunk at byte {info.offset} "
                                    "(not a tensor)")
        view.seek(0)
        check_byte_order(view, file)
    return stored_block(file, tensor, info.offset, start)


def dcp_tensors(directory: Path, metadata: Metadata, paths: Iterable[str]
                ) -> dict[str, StreamedTensor]:
    """The tensors DCP saved under ``paths`` in ``directory`` (its ``metadata``, checked by
    ``load_metadata``), as streamed tensors made of the chunks every rank wrote: each
    chunk's stored block, which must have the chunk's shape and the tensor's dtype (a
    crafted file could store another chunk's block under its key)."""
    tensors = {}
    for path in paths:
        entry = metadata.state_dict_metadata[path]
        shape, dtype = tuple(entry.size), entry.properties.dtype
        blocks = []
        for chunk in entry.chunks:
            start = tuple(chunk.offsets)
            stored = metadata.storage_data[MetadataIndex(path, chunk.offsets)]
            block = _dcp_block(directory, stored, start)
            if tuple(block.shape) != tuple(chunk.sizes) or block.dtype != dtype:
                raise StoredTensorError(
                    f"{directory}: its chunk of {path} at {list(start)} holds a "
                    f"{list(block.shape)} {block.dtype} block, not the chunk's "
                    f"{list(chunk.sizes)} {dtype} (a corrupted or crafted checkpoint)")
            blocks.append(block)
        tensors[path] = StreamedTensor(shape, dtype, tuple(blocks))
    return tensors
