"""Per-update timing and a profile of a few steady updates, for ``fairseq-shard-measure-train``.

:class:`UpdateClock` notes when each update's optimizer step begins (on a GPU after the
work queued so far has finished, so each interval is one whole update), for
steady-state speed over chosen updates instead of an epoch summary that includes start-up;
:class:`StepDurations` how long each optimizer step itself took (with ``--cpu-offload``, the
host's Adam step that the update waits for).

:class:`UpdateProfile` runs ``torch.profiler`` over updates ``first``..``last`` and keeps
what says where a step's time goes: the kernels that took the most device time, kernel
launches per update, and per update the wall time against the time the device was busy
(the union of kernel intervals). A step whose device is busy for much less than its wall
time is bound by the host (Python, dispatch, launches) rather than by the GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class UpdateClock:
    """The times at which every update's optimizer step began, in seconds."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def __call__(self) -> None:
        _synchronize()
        self.starts.append(time.perf_counter())


class StepDurations:
    """Seconds each optimizer step took, from its start to its end (device work finished
    at both ends); :meth:`started` and :meth:`ended` are the step's pre- and post-hooks."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def started(self) -> None:
        _synchronize()
        self._start = time.perf_counter()

    def ended(self) -> None:
        _synchronize()
        self.seconds.append(time.perf_counter() - self._start)


class UpdateProfile:
    """``torch.profiler`` over updates ``first``..``last`` (from the optimizer step of update
    ``first - 1`` to that of ``last``: ``last - first + 1`` whole updates)."""

    def __init__(self, first: int, last: int) -> None:
        if not 2 <= first <= last:
            raise ValueError(f"profile updates {first}-{last}: give 2 <= FIRST <= LAST")
        self.first, self.last = first, last
        self.updates = 0
        self._profiler: Any = None
        self._walls: list[float] = []
        self.summary: dict[str, Any] | None = None

    def __call__(self) -> None:
        """At each optimizer step (the ``updates``-th, counted from 1)."""
        self.updates += 1
        if self.updates == self.first - 1:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            _synchronize()
            self._profiler = profile(activities=activities)
            self._profiler.__enter__()
            self._walls.append(time.perf_counter())
        elif self._profiler is not None and self.updates <= self.last:
            _synchronize()
            self._walls.append(time.perf_counter())
            if self.updates == self.last:
                self.finish()

    def finish(self) -> None:
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        self.summary = summarize(profiler, self._walls)


def _kernels(profiler: Any) -> list[Any]:
    from torch.autograd import DeviceType

    return [event for event in profiler.events()
            if event.device_type == DeviceType.CUDA and event.time_range.elapsed_us() > 0]


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def summarize(profiler: Any, walls: list[float], top: int = 12) -> dict[str, Any]:
    """The profile as a small record: top kernels by device time, launches and busy time
    per update, wall time per update."""
    updates = max(len(walls) - 1, 1)
    kernels = _kernels(profiler)
    by_name: dict[str, list[float]] = {}
    for kernel in kernels:
        by_name.setdefault(kernel.name, []).append(kernel.time_range.elapsed_us())
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    busy = _busy_us([(k.time_range.start, k.time_range.end) for k in kernels])
    wall_ms = [1000 * (b - a) for a, b in zip(walls, walls[1:], strict=False)]
    operators = [event for event in profiler.events() if event.name.startswith("aten::")]
    return {
        "updates": updates,
        "wall_ms_per_update": round(sum(wall_ms) / updates, 2),
        "device_busy_ms_per_update": round(busy / 1000 / updates, 2),
        "kernel_launches_per_update": round(len(kernels) / updates, 1),
        "aten_calls_per_update": round(len(operators) / updates, 1),
        "top_kernels": [{"name": name[:120], "ms_per_update": round(sum(times) / 1000 / updates,
                                                                    3),
                         "calls_per_update": round(len(times) / updates, 1)}
                        for name, times in ranked],
    }


def at_every_update(*calls: Callable[[], None]) -> Any:
    """Call each of ``calls`` as every torch optimizer step begins (torch's global
    optimizer-step pre-hook: fairseq's, fairscale's and the plugin's optimizers all step a
    torch optimizer once per update); returns the hook's handle."""
    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        for call in calls:
            call()

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    return register_optimizer_step_pre_hook(hook)


def after_every_update(call: Callable[[], None]) -> Any:
    """Call ``call`` as every torch optimizer step ends (the global post-hook)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    return register_optimizer_step_post_hook(lambda optimizer, args, kwargs: call())
