"""``torch.save``'s file format, written one tensor at a time.

``torch.save`` pickles the whole object while it holds every tensor in memory. A torch
checkpoint is a zip archive whose ``data.pkl`` refers to each tensor's storage by a key
(``persistent_id`` ``("storage", torch.FloatStorage, "0", "cpu", numel)``, rebuilt by
``torch._utils._rebuild_tensor_v2``), followed by one record ``data/<key>`` per storage,
written in key order, then the version records. :func:`write_checkpoint` pickles the
object with :class:`LazyTensor` placeholders, which need only a shape and a dtype, then
asks each placeholder for its tensor just before writing its record and lets it go right
after: the peak is one tensor. The records are written with torch's own zip writer
(``torch._C.PyTorchFileWriter``, as ``torch.save`` does), so the file is what
``torch.save`` would have written for the same tensors, read by ``torch.load`` with
``weights_only=True`` (and ``mmap=True``). A placeholder met twice is stored once and
loads as one tensor (a tied weight).
"""

from __future__ import annotations

import collections
import contextlib
import io
import pickle
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
from torch.utils.serialization import config as serialization_config


class LazyTensor(ABC):
    """A tensor written to a checkpoint only when its record is due: subclasses give the
    ``shape`` and ``dtype`` it will have and :meth:`materialize` it (contiguous, on CPU)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @abstractmethod
    def materialize(self) -> torch.Tensor:
        """The tensor's values, contiguous, on CPU."""


class ResidentTensor(LazyTensor):
    """A tensor already in memory (any tensor the pickled object holds as such)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype

    def materialize(self) -> torch.Tensor:
        return self.tensor.detach().cpu().contiguous()


@dataclass(eq=False)
class _StorageRecord:
    """The storage of one written tensor: its record's key, element type and length."""

    key: str
    dtype: torch.dtype
    numel: int


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _storage_type(dtype: torch.dtype) -> Any:
    """The legacy storage class torch pickles for ``dtype`` (``torch.FloatStorage``, ...)."""
    name = torch.storage.TypedStorage(dtype=dtype, device="meta", _internal=True)
    return getattr(torch, name._pickle_storage_type())


class _CheckpointPickler(pickle.Pickler):
    """Pickles :class:`LazyTensor` s as torch does tensors, numbering their storages; any
    other tensor is first turned into one by ``as_lazy``."""

    def __init__(self, stream: BinaryIO,
                 as_lazy: Callable[[torch.Tensor], LazyTensor]) -> None:
        super().__init__(stream, protocol=torch.serialization.DEFAULT_PROTOCOL)
        self.as_lazy = as_lazy
        self.records: dict[int, tuple[_StorageRecord, LazyTensor]] = {}

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            obj = self.as_lazy(obj)
        if not isinstance(obj, LazyTensor):
            return NotImplemented
        if id(obj) not in self.records:
            numel = 1
            for size in obj.shape:
                numel *= size
            record = _StorageRecord(str(len(self.records)), obj.dtype, numel)
            self.records[id(obj)] = (record, obj)
        record = self.records[id(obj)][0]
        return (torch._utils._rebuild_tensor_v2,
                (record, 0, tuple(obj.shape), _contiguous_strides(tuple(obj.shape)), False,
                 collections.OrderedDict()))

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRecord):
            return ("storage", _storage_type(obj.dtype), obj.key, "cpu", obj.numel)
        return None


def _write_tensor(writer: Any, record: _StorageRecord, lazy: LazyTensor) -> None:
    """One storage record; the tensor is dropped on return."""
    tensor = lazy.materialize()
    if tensor.dtype != record.dtype or tuple(tensor.shape) != tuple(lazy.shape):
        raise ValueError(f"{type(lazy).__name__} gave a {tensor.dtype} tensor of shape "
                         f"{list(tensor.shape)} for {record.dtype} {list(lazy.shape)}")
    nbytes = record.numel * record.dtype.itemsize
    if (not tensor.is_contiguous() or tensor.storage_offset()
            or tensor.untyped_storage().nbytes() != nbytes):  # a view: its own bytes only
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    writer.write_record(f"data/{record.key}", tensor.untyped_storage(), nbytes)


class _Sink:
    """The file as torch's writer sees it; takes nothing once the write is abandoned."""

    def __init__(self, out: BinaryIO) -> None:
        self.out, self.open = out, True

    def write(self, data: Any) -> int:
        return self.out.write(data) if self.open else memoryview(data).nbytes


def _abandon(writer: Any, sink: _Sink) -> None:
    """Finish an unfinished archive into nothing. torch's writer otherwise finishes it when
    destroyed, and a failure there (as after a full disk) aborts the process."""
    sink.open = False
    with contextlib.suppress(Exception):
        writer.write_end_of_file()


def write_checkpoint(
    out: BinaryIO, obj: Any,
    as_lazy: Callable[[torch.Tensor], LazyTensor] = ResidentTensor,
) -> None:
    """Write ``obj`` to the open binary file ``out`` in ``torch.save``'s format, its
    :class:`LazyTensor` s (and tensors, through ``as_lazy``) one at a time."""
    pickled = io.BytesIO()
    pickler = _CheckpointPickler(pickled, as_lazy)
    pickler.dump(obj)
    alignment = serialization_config.save.storage_alignment
    sink = _Sink(out)
    writer = torch._C.PyTorchFileWriter(sink, True, alignment)  # CRC-32s, as torch.save
    try:
        data = pickled.getvalue()
        writer.write_record("data.pkl", data, len(data))
        for name, value in ((".format_version", "1"), (".storage_alignment", str(alignment)),
                            ("byteorder", sys.byteorder)):
            writer.write_record(name, value, len(value))
        for record, lazy in pickler.records.values():
            _write_tensor(writer, record, lazy)
        writer.write_end_of_file()
    except BaseException:
        _abandon(writer, sink)
        raise
