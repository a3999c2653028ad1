"""The offloaded Adam update, unit by unit in the background, hidden behind the next forward.

With ``--cpu-offload`` every update waits for the host's Adam step over the whole model.
Its result is exact only once the global gradient norm is known (clipping scales every
gradient, and an fp16 overflow skips the step), so it cannot start before backward ends
without changing fairseq's results. What can wait is the *use* of its result: unit ``k``'s
updated shards are first read when unit ``k``'s next forward gathers them. So after the
gradient norm, the step is handed to one background thread as one job per unit, in the
order the forward runs the units, and each unit's forward waits for its own job only: the
host updates unit ``k + 1`` while the device computes unit ``k``. The arithmetic, its
order within a unit and every input are those of the step run in line, so the results
are bit-identical.

Everything else that reads the shards or the optimizer state waits for all jobs first:
the next step, state dicts (checkpoints), loading, and validation. Code outside
fairseq's loop that reads parameters between updates calls :meth:`wait_all` itself.
``--no-host-step-overlap`` runs the step in line again.

FSDP2's explicit forward prefetch (not used by the plugin) would gather unit ``k + 1``
before its forward hook runs, and would need that unit's job to be waited for first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch.nn as nn


def owning_units(root: nn.Module, units: Sequence[Sequence[nn.Module]]) -> dict[int, int]:
    """``id(parameter) -> unit index``: each parameter belongs to its nearest enclosing unit
    module (as FSDP manages it: inner units take their parameters first). The root module
    must be one of the units' modules; parameters tied across modules belong to the first
    unit that reaches them in module order, the unit that also holds them in FSDP."""
    unit_of_module = {id(module): index for index, modules in enumerate(units)
                      for module in modules}
    if id(root) not in unit_of_module:
        raise ValueError("the root module must be one of the units")
    owners: dict[int, int] = {}
    pending = [(root, unit_of_module[id(root)])]
    while pending:
        module, current = pending.pop()
        current = unit_of_module.get(id(module), current)
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), current)
        # children pushed in reverse, so they are visited in module order
        pending.extend((child, current) for child in reversed(list(module.children())))
    return owners


class BackgroundHostStep:
    """One background thread running per-unit jobs in forward order; forward hooks that
    make each unit wait for its own job."""

    def __init__(self, units: Sequence[Sequence[nn.Module]]) -> None:
        self.units = [tuple(modules) for modules in units]
        self.forward_order: list[int] = []  # units in the order of the first forward
        self.waited_seconds = 0.0  # time spent waiting for jobs (see take_waited_seconds)
        self._seen: set[int] = set()
        self._pending: dict[int, Future[None]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-adam")
        self._handles = [
            module.register_forward_pre_hook(self._before_forward(index), prepend=True)
            for index, modules in enumerate(self.units) for module in modules]
        for modules in self.units:  # state dicts of any unit read or write every shard
            for module in modules:
                self._handles.append(module.register_state_dict_pre_hook(self._wait_all_hook))
                self._handles.append(
                    module.register_load_state_dict_pre_hook(self._wait_all_hook))

    def _before_forward(self, unit: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: object) -> None:
            if unit not in self._seen:
                self._seen.add(unit)
                self.forward_order.append(unit)
            self.wait(unit)

        return hook

    def _wait_all_hook(self, *args: object) -> None:
        self.wait_all()

    def order(self) -> list[int]:
        """Units in the order their forwards run (those never seen in a forward last)."""
        return self.forward_order + [unit for unit in range(len(self.units))
                                     if unit not in self._seen]

    def run(self, jobs: dict[int, Callable[[], None]]) -> None:
        """Queue one job per unit, in forward order, after any still queued."""
        for unit in self.order():
            if unit in jobs:
                self.wait(unit)  # a unit's jobs never overlap (none is queued normally)
                self._pending[unit] = self._executor.submit(jobs[unit])

    def wait(self, unit: int) -> None:
        """Block until ``unit``'s job has finished; re-raise what it raised."""
        future = self._pending.pop(unit, None)
        if future is None:
            return
        start = time.perf_counter()
        try:
            future.result()
        finally:
            self.waited_seconds += time.perf_counter() - start

    def wait_all(self) -> None:
        """Block until every queued job has finished, in the order they run."""
        for unit in self.order():
            self.wait(unit)

    def take_waited_seconds(self) -> float:
        """Seconds spent waiting since the last call."""
        waited, self.waited_seconds = self.waited_seconds, 0.0
        return waited

    def close(self) -> None:
        """Finish the queued jobs and remove the hooks."""
        self.wait_all()
        for handle in self._handles:
            handle.remove()
        self._executor.shutdown()


def jobs_by_unit(indices: Iterable[int], unit_of: Callable[[int], int]
                 ) -> dict[int, list[int]]:
    """``indices`` grouped by their unit, each group in the order given."""
    grouped: dict[int, list[int]] = {}
    for index in indices:
        grouped.setdefault(unit_of(index), []).append(index)
    return grouped
