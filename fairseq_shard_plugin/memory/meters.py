"""Per-rank memory measurement: CUDA allocator statistics, or live CPU tensor bytes.

PyTorch keeps no allocator statistics for CPU tensors, so on CPU the peak is measured by
:class:`LiveTensorMeter`, a dispatch mode that sees every tensor an operator returns and
counts the bytes of each distinct storage until Python frees it. FSDP frees and regrows
gathered parameters with ``UntypedStorage.resize_``, which the dispatcher does not see, so
the meter also follows resizes while it is active. Its frees come from Python's reference
counting, so tensors released by communication threads are followed too; but a dispatch mode
changes what autograd does (a tensor used several times gets its gradients summed out of
place) and does not see buffers allocated inside operators. ``allocator_meter`` has the
exact single-threaded alternative that ``benchmarks/memory.py`` uses.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

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


class MeterUnavailable(RuntimeError):
    """Another torch profiler is running, so the CPU allocator's events are not ours to read."""


class _ResizeWatch:
    """Reference-counted patch of ``UntypedStorage.resize_`` that notifies active meters."""

    meters: list[LiveTensorMeter] = []
    original = None

    @classmethod
    def add(cls, meter: LiveTensorMeter) -> None:
        if not cls.meters:
            cls.original = torch.UntypedStorage.resize_
            original = cls.original

            def resize_(storage: torch.UntypedStorage, size: int) -> Any:
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

    For CPU offload, storages can be marked as host-side (:meth:`mark_host`, ``host``
    tensors, everything allocated while ``host_phase`` is set): ``device_peak_bytes`` is
    the peak of the live bytes without them, i.e. what an accelerator would have held.
    """

    def __init__(
        self, resident: Iterable[torch.Tensor] = (), host: Iterable[torch.Tensor] = ()
    ) -> None:
        super().__init__()
        # id(storage) -> [weak reference, counted bytes, host-side]. PyTorch keeps one
        # Python object per live storage, and the weak reference's callback drops the entry
        # before that id can be reused, so ids identify storages while they are tracked.
        self._tracked: dict[int, list] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.host_bytes = 0
        self.device_peak_bytes = 0
        self.host_phase = False
        self.marks: dict[str, int] = {}
        for tensor in resident:
            self._track(tensor)
        for tensor in host:
            self.mark_host(tensor)

    def __enter__(self) -> LiveTensorMeter:
        _ResizeWatch.add(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        _ResizeWatch.remove(self)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
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
                ref = weakref.ref(storage, lambda _, key=key: self._freed(key))
                entry = [ref, 0, self.host_phase]
                self._tracked[key] = entry
            self._set(entry, storage.nbytes())

    def mark(self, name: str) -> None:
        """Remember the live bytes at this moment, under ``name`` in :attr:`marks`."""
        self.marks[name] = self.live_bytes

    def mark_host(self, tensor: torch.Tensor) -> None:
        """Count the storages behind ``tensor`` as host-side from now on."""
        host_phase, self.host_phase = self.host_phase, True
        try:
            self._track(tensor)  # new entries start host-side
        finally:
            self.host_phase = host_phase
        for storage in tensor_storages(tensor):
            entry = self._tracked.get(id(storage))
            if entry is not None and not entry[2]:
                entry[2] = True
                self.host_bytes += entry[1]

    def resized(self, storage: torch.UntypedStorage) -> None:
        entry = self._tracked.get(id(storage))
        if entry is not None:
            self._set(entry, storage.nbytes())

    def _set(self, entry: list, nbytes: int) -> None:
        change = nbytes - entry[1]
        self.live_bytes += change
        entry[1] = nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        if entry[2]:
            self.host_bytes += change
        elif self.live_bytes - self.host_bytes > self.device_peak_bytes:
            self.device_peak_bytes = self.live_bytes - self.host_bytes

    def _freed(self, key: int) -> None:
        entry = self._tracked.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[1]
            if entry[2]:
                self.host_bytes -= entry[1]


@dataclass(frozen=True)
class StepMemory:
    """Peak memory of one training step on one rank, in bytes."""

    peak_allocated: int
    peak_reserved: int | None  # CUDA only: what the caching allocator held
    # accelerator-side peak: CUDA's peak allocated; on CPU the live bytes without host-side
    # (offloaded) storages, see LiveTensorMeter
    peak_device: int | None = None
    # bytes allocated at each StepMemoryProbe.mark of the step, by name
    marks: dict[str, int] = field(default_factory=dict)


def process_memory(names: Iterable[str], pid: int | str = "self", table: str = "status"
                   ) -> dict[str, int]:
    """The memory fields ``names`` of a process as Linux reports them in
    ``/proc/PID/TABLE`` (``status``: ``VmHWM``, ``RssAnon``, ...; ``smaps_rollup``:
    ``Pss_File``, ...), in bytes; a field the table lacks is left out. Raises ``OSError``
    where the table cannot be read (no such process, not Linux)."""
    wanted = set(names)
    fields = {}
    with open(f"/proc/{pid}/{table}") as lines:
        for line in lines:
            name, _, value = line.partition(":")
            if name in wanted and value.split():
                fields[name] = int(value.split()[0]) * 1024  # the kernel counts kB
    return fields


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux ``VmHWM``), 0 where unavailable."""
    try:
        return process_memory(["VmHWM"]).get("VmHWM", 0)
    except OSError:
        return 0


class StepMemoryProbe:
    """Measure the peak memory of one step: CUDA allocator statistics, else a CPU meter
    (``meter``: :class:`LiveTensorMeter` or ``allocator_meter.AllocatorMeter``)."""

    def __init__(self, device: torch.device, meter: Callable[..., Any] | None = None) -> None:
        self.device = device
        self.result: StepMemory | None = None
        self._meter_class = meter or LiveTensorMeter
        self._meter: Any = None
        self._cuda_marks: dict[str, int] = {}

    def start(
        self, resident: Iterable[torch.Tensor], host: Iterable[torch.Tensor] = ()
    ) -> None:
        """``host``: resident tensors that live on the host (offloaded), CPU meter only."""
        self.result = None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_marks = {}
            return
        meter = self._meter_class(resident, host)
        try:
            meter.__enter__()
        except MeterUnavailable:  # the allocator meter while the user's own profiler runs
            return
        self._meter = meter

    @property
    def meter(self) -> Any:
        """The active CPU meter (to mark offloaded storages), None on CUDA or between steps."""
        return self._meter

    def mark(self, name: str) -> None:
        """Record the bytes allocated now, as ``StepMemory.marks[name]``."""
        if self.device.type == "cuda":
            self._cuda_marks[name] = torch.cuda.memory_allocated(self.device)
        elif self._meter is not None:
            self._meter.mark(name)

    def stop(self) -> StepMemory | None:
        """The step's figures, None when it could not be measured."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            self.result = StepMemory(peak, torch.cuda.max_memory_reserved(self.device), peak,
                                     dict(self._cuda_marks))
        elif self._meter is not None:
            meter, self._meter = self._meter, None
            meter.__exit__(None, None, None)
            self.result = StepMemory(meter.peak_bytes, None, meter.device_peak_bytes,
                                     dict(meter.marks))
        return self.result


def watch_offloaded_state(
    probe: Callable[[], StepMemoryProbe | None], params: Iterable[torch.nn.Parameter]
) -> list[RemovableHandle]:
    """Under CPU offload on CPU ranks, tell the current probe's meter (``probe()``, read at
    each event, so a probe replaced later is followed) what an accelerator would not hold:
    each sharded gradient once FSDP has reduced it (FSDP then copies it to the host), and
    everything allocated during an optimizer step (which runs on the host)."""

    def meter() -> Any:
        current = probe()
        return None if current is None else current.meter

    def gradient_reduced(param: torch.Tensor) -> None:
        active = meter()
        if active is not None and param.grad is not None:
            active.mark_host(param.grad)

    def optimizer_step(host_phase: bool) -> Callable[..., None]:
        def hook(*_: object) -> None:
            active = meter()
            if active is not None:
                active.host_phase = host_phase

        return hook

    handles = [p.register_post_accumulate_grad_hook(gradient_reduced)
               for p in params if p.requires_grad]
    handles.append(register_optimizer_step_pre_hook(optimizer_step(True)))
    handles.append(register_optimizer_step_post_hook(optimizer_step(False)))
    return handles
