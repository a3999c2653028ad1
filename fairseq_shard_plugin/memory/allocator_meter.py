"""Peak CPU tensor memory from the CPU allocator's own events, without perturbing anything.

The torch profiler's memory events record every CPU allocation and free with its address
and size; :class:`AllocatorMeter` replays them after the measured region. It sees buffers
that operators allocate internally, and it does not change what it measures: under the
dispatch mode of :class:`.memory.LiveTensorMeter` (and any ``TorchDispatchMode``) autograd
sums the gradients of a tensor used several times out of place, which at the NLLB-600M shape
adds a whole extra copy of the tied 256K x 1024 vocabulary gradient (0.49 GiB).

The profiler records the frees of the thread that allocated a tensor only: a tensor freed by
another thread (a gloo communication thread dropping the last reference to a buffer) stays
counted. It is exact for single-threaded steps, such as ``benchmarks/memory.py``'s fake
process group; multi-rank gloo runs use :class:`.memory.LiveTensorMeter`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch._C._autograd import _disable_profiler, _enable_profiler, _prepare_profiler
from torch._C._profiler import (
    ProfilerActivity,
    ProfilerConfig,
    ProfilerState,
    _ExperimentalConfig,
)
from torch.autograd.profiler import record_function

from fairseq_shard_plugin.memory.meters import MeterUnavailable, tensor_storages

_MARKER = "fairseq_shard_plugin.meter"
_CPU_ONLY = {ProfilerActivity.CPU}


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


class AllocatorMeter:
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
        self._live: dict[int, list] = {}  # pointer -> [bytes, host-side]
        for tensors, on_host in ((resident, False), (host, True)):
            for tensor in tensors:
                for storage in tensor_storages(tensor):
                    if storage.device.type == "cpu" and storage.nbytes():
                        self._live[storage.data_ptr()] = [storage.nbytes(), on_host]
        self._live_bytes = sum(nbytes for nbytes, _ in self._live.values())
        self.host_bytes = sum(nbytes for nbytes, on_host in self._live.values() if on_host)
        self.peak_bytes = self._live_bytes
        self.device_peak_bytes = self._live_bytes - self.host_bytes
        self._host_phase = False
        self._replayed_host_phase = False
        self._stale_frees: dict[int, int] = {}  # address -> frees already counted
        self._marks: dict[str, int] = {}
        self._recording = False

    def __enter__(self) -> AllocatorMeter:
        if torch.autograd.profiler._is_profiler_enabled:
            raise MeterUnavailable("a torch profiler is already running")
        self._start_session()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end_session()

    def _start_session(self) -> None:
        # libkineto prints two lines per profiling session unless told otherwise
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        # the profiler's low-level session API: no Python objects that a later garbage
        # collection would have to tear down while another session records
        config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False,
                                _ExperimentalConfig())
        _prepare_profiler(config, _CPU_ONLY)
        _enable_profiler(config, _CPU_ONLY)
        self._recording = True

    def _end_session(self) -> None:
        assert self._recording, "no profiling session"
        self._recording = False
        self._replay(_allocator_events(_disable_profiler()))

    @property
    def active(self) -> bool:
        return self._recording

    def mark(self, name: str) -> None:
        """Remember the live bytes at this moment, under ``name`` in :attr:`marks`."""
        if self.active:
            with record_function(f"{_MARKER}:mark:{id(self)}:{name}"):
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
        """Advance the live state over a session's events."""
        live, live_bytes, host_bytes = self._live, self._live_bytes, self.host_bytes
        peak, device_peak = self.peak_bytes, self.device_peak_bytes
        host_phase = self._replayed_host_phase
        stale_frees = self._stale_frees
        for event in events:
            if event.marker:
                action, _, value = event.marker.partition(":")
                if action == "mark":
                    owner, _, name = value.partition(":")
                    if owner == str(id(self)):
                        self._marks[name] = live_bytes
                elif action == "phase":
                    host_phase = value == "1"
                elif (entry := live.get(int(value))) is not None and not entry[1]:
                    entry[1] = True  # action "host": a storage moved to the host
                    host_bytes += entry[0]
            elif event.size > 0:
                if (entry := live.get(event.pointer)) is not None:
                    # the address is reused: its free carries the same timestamp and was
                    # ordered after this allocation; count the free now, skip it later
                    live_bytes -= entry[0]
                    host_bytes -= entry[0] if entry[1] else 0
                    stale_frees[event.pointer] = stale_frees.get(event.pointer, 0) + 1
                live[event.pointer] = [event.size, host_phase]
                live_bytes += event.size
                host_bytes += event.size if host_phase else 0
            elif stale_frees.get(event.pointer):
                stale_frees[event.pointer] -= 1
            elif (entry := live.pop(event.pointer, None)) is not None:
                # frees of storages allocated before the region that were not declared
                # resident are unknown here and ignored (an overestimate, never an under-)
                live_bytes -= entry[0]
                host_bytes -= entry[0] if entry[1] else 0
            peak = max(peak, live_bytes)
            device_peak = max(device_peak, live_bytes - host_bytes)
        self._live_bytes, self.host_bytes = live_bytes, host_bytes
        self.peak_bytes, self.device_peak_bytes = peak, device_peak
        self._replayed_host_phase = host_phase
