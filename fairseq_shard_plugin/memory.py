"""Per-rank memory measurement: CUDA allocator statistics, or live CPU tensor bytes.

PyTorch keeps no allocator statistics for CPU tensors, so on CPU the peak is measured by
:class:`LiveTensorMeter` from the CPU allocator's own event stream (the torch profiler with
memory profiling records every allocation and free with its address and size). Unlike a
dispatch-mode meter, it does not change what it measures: under any ``TorchDispatchMode``,
autograd sums the gradients of a tensor used several times out of place, which at the NLLB
shape adds a whole extra copy of the 256K x d vocabulary gradient (0.49 GiB) to the peak.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.autograd.profiler import record_function
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.hooks import RemovableHandle

GIB = 1024**3
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_MARKER = "fairseq_shard_plugin.meter"


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


class _Event(NamedTuple):
    time_ns: int
    order: int
    pointer: int = 0  # allocations and frees
    size: int = 0  # bytes: positive for an allocation, negative for a free
    marker: str = ""  # a meter marker's name, without the prefix


def _allocator_events(result: object) -> list[_Event]:
    """Every CPU allocation, free and meter marker of a profiling session, in time order."""
    events: list[_Event] = []
    pending = list(result.experimental_event_tree())  # type: ignore[attr-defined]
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == torch._C._profiler._EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu":
                events.append(_Event(event.start_time_ns, len(events), fields.ptr,
                                     fields.alloc_size))
        elif event.name.startswith(_MARKER):
            events.append(_Event(event.start_time_ns, len(events),
                                 marker=event.name[len(_MARKER) + 1:]))
    events.sort(key=lambda e: (e.time_ns, e.order))
    return events


class LiveTensorMeter:
    """Peak live CPU tensor bytes of a code region; use as a context manager around it.

    ``resident`` tensors that already exist (parameters, gradients, optimizer state) are
    counted from the start. The allocator's events are replayed when the region ends, so the
    figures (``peak_bytes``, ``device_peak_bytes``, ``marks``) exist only after it.

    For CPU offload, storages can be marked as host-side (``host`` tensors, :meth:`mark_host`,
    everything allocated while ``host_phase`` is set): ``device_peak_bytes`` is the peak of
    the live bytes without them, i.e. what an accelerator would have held.
    """

    def __init__(
        self, resident: Iterable[torch.Tensor] = (), host: Iterable[torch.Tensor] = ()
    ) -> None:
        self._initial: dict[int, tuple[int, bool]] = {}  # pointer -> (bytes, host-side)
        for tensors, on_host in ((resident, False), (host, True)):
            for tensor in tensors:
                for storage in tensor_storages(tensor):
                    if storage.device.type == "cpu" and storage.nbytes():
                        self._initial[storage.data_ptr()] = (storage.nbytes(), on_host)
        self.peak_bytes = 0
        self.device_peak_bytes = 0
        self.host_bytes = 0
        self._host_phase = False
        self._marks: dict[str, int] = {}
        self._profile: profile | None = None

    def __enter__(self) -> LiveTensorMeter:
        if torch.autograd.profiler._is_profiler_enabled:
            raise MeterUnavailable("a torch profiler is already running")
        # libkineto prints two lines per profiling session unless told otherwise
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._profile is not None, "__exit__ without __enter__"
        self._profile.__exit__(None, None, None)
        self._replay(_allocator_events(self._profile.profiler.kineto_results))
        self._profile = None

    @property
    def active(self) -> bool:
        return self._profile is not None

    def mark(self, name: str) -> None:
        """Remember the live bytes at this moment, under ``name`` in :attr:`marks`."""
        if self.active:
            with record_function(f"{_MARKER}:mark:{name}"):
                pass

    @property
    def marks(self) -> dict[str, int]:
        """Live bytes at each :meth:`mark`, by name (after the region)."""
        return dict(self._marks)

    def mark_host(self, tensor: torch.Tensor) -> None:
        """Count the storages behind ``tensor`` as host-side from now on."""
        if self.active:
            for storage in tensor_storages(tensor):
                with record_function(f"{_MARKER}:host:{storage.data_ptr()}"):
                    pass

    @property
    def host_phase(self) -> bool:
        return self._host_phase

    @host_phase.setter
    def host_phase(self, value: bool) -> None:
        """While set, new allocations are host-side (an optimizer step on offloaded state)."""
        self._host_phase = value
        if self.active:
            with record_function(f"{_MARKER}:phase:{int(value)}"):
                pass

    def _replay(self, events: list[_Event]) -> None:
        live = {ptr: list(entry) for ptr, entry in self._initial.items()}
        live_bytes = sum(nbytes for nbytes, _ in live.values())
        host_bytes = sum(nbytes for nbytes, on_host in live.values() if on_host)
        peak, device_peak, host_phase = live_bytes, live_bytes - host_bytes, False
        for event in events:
            if event.marker:
                action, _, value = event.marker.partition(":")
                if action == "mark":
                    self._marks[value] = live_bytes
                elif action == "phase":
                    host_phase = value == "1"
                elif (entry := live.get(int(value))) is not None and not entry[1]:
                    entry[1] = True  # action "host": a storage moved to the host
                    host_bytes += entry[0]
            elif event.size > 0:
                live[event.pointer] = [event.size, host_phase]
                live_bytes += event.size
                host_bytes += event.size if host_phase else 0
            elif (entry := live.pop(event.pointer, None)) is not None:
                # frees of storages allocated before the region that were not declared
                # resident are unknown here and ignored (an overestimate, never an under-)
                live_bytes -= entry[0]
                host_bytes -= entry[0] if entry[1] else 0
            peak = max(peak, live_bytes)
            device_peak = max(device_peak, live_bytes - host_bytes)
        self.peak_bytes, self.device_peak_bytes, self.host_bytes = peak, device_peak, host_bytes


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
        meter = LiveTensorMeter(resident, host)
        try:
            meter.__enter__()
        except MeterUnavailable:  # the user is profiling: this step goes unmeasured
            return
        self._meter = meter

    @property
    def meter(self) -> LiveTensorMeter | None:
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
                                     meter.marks)
        return self.result


def watch_offloaded_state(
    probe: StepMemoryProbe, params: Iterable[torch.nn.Parameter]
) -> list[RemovableHandle]:
    """Under CPU offload on CPU ranks, tell the probe's meter what an accelerator would not
    hold: each sharded gradient once FSDP has reduced it (FSDP then copies it to the host),
    and everything allocated during an optimizer step (which runs on the host)."""

    def gradient_reduced(param: torch.Tensor) -> None:
        if probe.meter is not None and param.grad is not None:
            probe.meter.mark_host(param.grad)

    def optimizer_step(host_phase: bool):  # type: ignore[no-untyped-def]
        def hook(*_: object) -> None:
            if probe.meter is not None:
                probe.meter.host_phase = host_phase

        return hook

    handles = [p.register_post_accumulate_grad_hook(gradient_reduced)
               for p in params if p.requires_grad]
    handles.append(register_optimizer_step_pre_hook(optimizer_step(True)))
    handles.append(register_optimizer_step_post_hook(optimizer_step(False)))
    return handles
