"""Per-rank memory measurement: CUDA allocator statistics, or live CPU tensor bytes.

PyTorch keeps no allocator statistics for CPU tensors, so on CPU the peak is measured by
:class:`LiveTensorMeter`, a dispatch mode that sees every tensor an operator returns and
counts the bytes of each distinct storage until Python frees it. FSDP frees and regrows
gathered parameters with ``UntypedStorage.resize_``, which the dispatcher does not see, so
the meter also follows resizes while it is active.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

GIB = 1024**3
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def tensor_storages(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """Yield the plain storages behind a tensor, looking through wrappers such as DTensor."""
    if type(tensor) in _PLAIN_TENSOR_TYPES:  # fast path: most operator outputs
        if tensor.device.type != "meta":
            yield tensor.untyped_storage()
        return
    pending = [tensor]
    while pending:
        current = pending.pop()
        if is_traceable_wrapper_subclass(current):
            names, _ = current.__tensor_flatten__()
            inner = (getattr(current, name) for name in names)
            pending.extend(t for t in inner if isinstance(t, torch.Tensor))
        elif current.device.type != "meta":
            yield current.untyped_storage()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by the distinct storages behind ``tensors`` (shared storage counted once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        for storage in tensor_storages(tensor):
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


class _ResizeWatch:
    """Reference-counted patch of ``UntypedStorage.resize_`` that notifies active meters."""

    meters: list[LiveTensorMeter] = []
    original = None

    @classmethod
    def add(cls, meter: LiveTensorMeter) -> None:
        if not cls.meters:
            cls.original = torch.UntypedStorage.resize_
            original = cls.original

            def resize_(storage: torch.UntypedStorage, size: int):  # type: ignore[no-untyped-def]
                result = original(storage, size)
                for active in cls.meters:
                    active.resized(storage)
                return result

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        cls.meters.append(meter)

    @classmethod
    def remove(cls, meter: LiveTensorMeter) -> None:
        cls.meters.remove(meter)
        if not cls.meters:
            torch.UntypedStorage.resize_ = cls.original  # type: ignore[method-assign]


class LiveTensorMeter(TorchDispatchMode):
    """Track live CPU tensor bytes and their peak while active.

    ``resident`` tensors that already exist (parameters, gradients, optimizer state) are
    counted from the start. Use as a context manager around the code to measure.
    """

    def __init__(self, resident: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        # id(storage) -> [weak reference, counted bytes]. PyTorch keeps one Python object
        # per live storage, and the weak reference's callback drops the entry before that
        # id can be reused, so ids identify storages while they are tracked.
        self._tracked: dict[int, list] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        for tensor in resident:
            self._track(tensor)

    def __enter__(self) -> LiveTensorMeter:
        _ResizeWatch.add(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        _ResizeWatch.remove(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self._track(out)
        else:
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self._track(leaf)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        for storage in tensor_storages(tensor):
            if storage.device.type != "cpu":
                continue
            entry = self._tracked.get(id(storage))
            if entry is None:
                key = id(storage)
                entry = [weakref.ref(storage, lambda _, key=key: self._freed(key)), 0]
                self._tracked[key] = entry
            self._set(entry, storage.nbytes())

    def resized(self, storage: torch.UntypedStorage) -> None:
        entry = self._tracked.get(id(storage))
        if entry is not None:
            self._set(entry, storage.nbytes())

    def _set(self, entry: list, nbytes: int) -> None:
        self.live_bytes += nbytes - entry[1]
        entry[1] = nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def _freed(self, key: int) -> None:
        entry = self._tracked.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[1]


@dataclass(frozen=True)
class StepMemory:
    """Peak memory of one training step on one rank, in bytes."""

    peak_allocated: int
    peak_reserved: int | None  # CUDA only: what the caching allocator held


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux ``VmHWM``), 0 where unavailable."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class StepMemoryProbe:
    """Measure the peak memory of one step: CUDA allocator statistics, else a live meter."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.result: StepMemory | None = None
        self._meter: LiveTensorMeter | None = None

    def start(self, resident: Iterable[torch.Tensor]) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._meter = LiveTensorMeter(resident)
            self._meter.__enter__()

    def stop(self) -> StepMemory:
        if self.device.type == "cuda":
            self.result = StepMemory(
                torch.cuda.max_memory_allocated(self.device),
                torch.cuda.max_memory_reserved(self.device),
            )
        else:
            assert self._meter is not None, "stop() without start()"
            self._meter.__exit__(None, None, None)
            self.result = StepMemory(self._meter.peak_bytes, None)
            self._meter = None
        return self.result
