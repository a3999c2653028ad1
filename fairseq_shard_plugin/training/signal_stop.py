"""Save and stop, on every rank at the same update, when the job is told to end.

Schedulers signal a job before they kill it: Slurm sends SIGTERM at preemption and
``scancel``, and the signal of ``--signal=USR1@120`` that long before the time limit;
torchrun passes SIGTERM on to its workers. Without a handler the ranks die mid-step and a
resume repeats every update since the last interval checkpoint. With ``--save-on-signal``
(SIGUSR1 and SIGTERM by default) a handler only records the signal; after each update the
ranks learn with one all-reduce of one number whether any of them got one, and then all of
them save ``checkpoint_last.pt`` (without validating: the time left is short) and leave
with exit code 128 + the signal's number, the code of a process ended by that signal, so
launchers and scripts see an unfinished run (torchrun's ``--max-restarts`` restarts it,
and the same command resumes). A repeated signal within :data:`PATIENCE_S` changes
nothing (under ``srun torchrun`` a worker can get the scheduler's signal and the one torchrun
forwards), nor does one once the ranks have agreed to stop (the save runs; the launchers'
own SIGKILL deadlines, torchrun's ``--shutdown-timeout`` and Slurm's KillWait, bound it). A
signal that comes later while the ranks have not agreed, because this rank waits in a
collective for a peer that hangs, ends the process at once with 128 + its number (an
operator's second ``kill`` used to be ignored until gloo's 30-minute timeout, T2 #3): a
thread sees it through the signal module's wakeup fd, as Python runs no handler then.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from types import FrameType

import torch
import torch.distributed as dist

from fairseq_shard_plugin.errors import tell_the_launcher
from fairseq_shard_plugin.sharding.options import DEFAULT_SIGNALS

logger = logging.getLogger(__name__)

# seconds after the first signal from which another one, before the ranks agreed to stop,
# ends the process (the first is recorded only)
PATIENCE_S = 10.0


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """``"SIGUSR1,SIGTERM"`` (names with or without ``SIG``) as signals; ``"none"``: none."""
    if text.strip().lower() in ("", "none"):
        return ()
    signals = []
    for name in text.split(","):
        name = name.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name in ("SIGKILL", "SIGSTOP") or not hasattr(signal.Signals, name):
            raise ValueError(
                f"--save-on-signal: {name} is not a signal a process can handle: give names "
                f"such as {DEFAULT_SIGNALS}, or none"
            )
        signals.append(signal.Signals[name])
    return tuple(signals)


class SignalStop:
    """Records the first of ``signals`` this process receives; :meth:`agreed` shares it."""

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self.signals = signals
        self.received: int | None = None  # this process's signal
        self._first_at = 0.0  # when it came (time.monotonic())
        self.stopped_by: int | None = None  # the signal all ranks stopped for

    def install(self) -> None:
        if not self.signals:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning("--save-on-signal: not installed (the trainer is not built on the "
                           "main thread, where Python runs signal handlers)")
            return
        for signum in self.signals:
            signal.signal(signum, self._record)
        self._watch_while_blocked()
        _keep_forked_workers_running()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        self._seen(signum)

    def _seen(self, signum: int) -> None:
        """Note a signal; end the process on a later one before the ranks agreed."""
        now = time.monotonic()
        if not self._first_at:
            self._first_at = now
        elif self.stopped_by is None and now - self._first_at >= PATIENCE_S:
            line = (f"fairseq-shard-plugin: {signal.Signals(signum).name} again, "
                    f"{PATIENCE_S:g} s or more after the first, before the ranks agreed to "
                    "stop (a peer does not answer?): ending without saving")
            os.write(2, f"{line}\n".encode())
            tell_the_launcher(line)
            os._exit(128 + signum)

    def _watch_while_blocked(self) -> None:
        """Python runs a signal's handler only between bytecodes of the main thread, never
        while it waits inside a collective for a peer that hangs (T4 #1); the C handler
        writes each signal's number to the wakeup fd at once, where a thread reads it.
        Left out where something else owns the wakeup fd; one thread a process, which
        serves whichever trainer's stop is current (:func:`install`)."""
        global _watching
        if _watching:
            return
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        try:
            previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        except ValueError:  # not the main thread of the main interpreter
            os.close(read_end), os.close(write_end)
            return
        if previous != -1:  # someone else's: theirs stays
            signal.set_wakeup_fd(previous)
            os.close(read_end), os.close(write_end)
            return

        def watch() -> None:
            while True:
                for signum in os.read(read_end, 64):
                    current = _current
                    if current is not None and signum in current.signals:
                        current._seen(signum)

        _watching = True
        threading.Thread(target=watch, name="save-on-signal watchdog", daemon=True).start()

    def agreed(self, device: torch.device) -> int | None:
        """The signal some rank received (the highest number if several), or None.
        A collective: every rank calls it at the same point of every update."""
        if not self.signals:
            return None
        flag = torch.tensor([self.received or 0], dtype=torch.int64, device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        if value:
            self.stopped_by = value
        return value or None


def _keep_forked_workers_running() -> None:
    """Block the stop signals in every process this one forks from now on: its DataLoader
    workers. A scheduler signals the whole process group (``scancel``, ``timeout``, Slurm's
    time limit), and torch's worker dies of SIGTERM from anyone but its parent; the rank then
    met "DataLoader worker ... exited unexpectedly" wherever it needed their next batch, in
    validation or within an update, before the stop's save (T1 #1, T4 #1-#2, session 25).
    Blocked, the signal stays pending in the worker, which keeps serving batches; it ends
    when its loader shuts it down, or when it sees that the rank is gone; at exit, where
    multiprocessing would end it with SIGTERM and wait, :func:`_end_daemon_children` ends
    it first. Processes started by ``subprocess`` are not affected (they run no fork
    handlers)."""
    global _blocking_in_children
    if _blocking_in_children:
        return

    def block_in_child() -> None:
        if _current is not None and _current.signals:
            signal.pthread_sigmask(signal.SIG_BLOCK, _current.signals)

    os.register_at_fork(after_in_child=block_in_child)
    atexit.register(_end_daemon_children)  # runs before multiprocessing's (registered first)
    _blocking_in_children = True


def _end_daemon_children() -> None:
    """At exit: multiprocessing ends the daemonic children (a loader's workers still
    running, mid-epoch) with SIGTERM and waits for them; they block it, so they get SIGKILL
    here first (SIGCHLD reset: torch's handler would report each as a failed worker)."""
    import multiprocessing

    daemons = [child for child in multiprocessing.active_children() if child.daemon]
    if not daemons:
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in daemons:
        child.kill()
    for child in daemons:
        child.join(timeout=5)


_current: SignalStop | None = None
_watching = False  # the wakeup-fd thread runs (one a process)
_blocking_in_children = False  # the fork handler of _keep_forked_workers_running is in


def install(signals: tuple[signal.Signals, ...]) -> SignalStop:
    """Install the handlers of this process's trainer; :func:`stopped_by` reads it."""
    global _current
    _current = SignalStop(signals)
    _current.install()
    return _current


def stopped_by() -> int | None:
    """The signal this process's training stopped for, or None."""
    return _current.stopped_by if _current is not None else None
