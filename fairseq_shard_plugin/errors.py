"""The one family of errors the plugin reports: each is a :class:`ShardPluginError`.

Every error a user can cause (a configuration that cannot work, a checkpoint that cannot
be loaded or written, a step out of memory, bad estimator input) derives from it, and its
message is one line that says what to change. The training entry point
(:mod:`.fairseq_integration`, hook 4) and the console scripts catch this base once and exit
with that line; in fairseq's other tools (``fairseq-generate``, ``fairseq-eval-lm``, which
have no such entry point) :func:`report_in_one_line` prints it when nothing caught it.
Anything else is a bug and keeps its traceback. Each subclass also keeps
the built-in base its callers relied on before (``ValueError``, ``RuntimeError``,
``OSError``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import NoReturn


class ShardPluginError(Exception):
    """Base of every one-line error of the plugin."""

    #: the same on every rank of a node (from the configuration or the node's files): the
    #: node's first rank prints it (:func:`prints_here`)
    node_wide = False


class ShardingConfigError(ShardPluginError, ValueError):
    """A configuration the plugin cannot train; the message says what to change."""


def error_behind(error: BaseException, wanted: Callable[[BaseException], bool]
                 ) -> BaseException | None:
    """The first exception that is ``wanted`` among ``error``, its causes and contexts and
    DCP's per-rank failures (``CheckpointException.failures``: (exception, stack) pairs)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if wanted(current):
            return current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                failure = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(failure, BaseException):
                    pending.append(failure)
        pending.extend((current.__cause__, current.__context__))
    return None


def report_in_one_line() -> None:
    """Let an uncaught :class:`ShardPluginError` end the process with its one line on stderr
    (exit code 1, as any uncaught exception) instead of a traceback; every other exception
    goes to the hook that was there before. Installed once, by :func:`..activate`."""
    previous = sys.excepthook
    if getattr(previous, "_shard_plugin_hook", False):
        return

    def hook(kind: type[BaseException], error: BaseException,
             traceback: TracebackType | None) -> None:
        if isinstance(error, ShardPluginError):
            print(f"fairseq-shard-plugin: error: {error}", file=sys.stderr)
        else:
            previous(kind, error, traceback)

    hook._shard_plugin_hook = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def tell_the_launcher(line: str) -> None:
    """Put ``line`` in the worker's error file under torchrun (``TORCHELASTIC_ERROR_FILE``,
    the file torchrun gives each worker for this), so that torchrun's closing "Root Cause"
    block names the error instead of a link to its documentation; nothing without it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as file:
            json.dump({"message": {"message": line, "extraInfo": {  # torchrun's own layout
                "py_callstack": line, "timestamp": str(int(time.time()))}}}, file)
    except OSError:
        pass  # the line is still on stderr


def prints_here(node_wide: bool = True) -> bool:
    """Whether this rank prints a one-line error. An error every rank of a node meets alike
    (``node_wide``) is printed by the node's first rank under torchrun, whose closing summary
    names it for every rank too; under srun, which may kill the printing rank first
    (``--kill-on-bad-exit``), and for any other error, by every rank."""
    if not node_wide or not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return True
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name]) == 0
    return True


def exit_with(line: str, status: int = 1, print_it: bool = True) -> NoReturn:
    """End the process with ``line`` on stderr (unless ``print_it`` is False: the same line
    comes from rank 0) and in torchrun's error file (:func:`tell_the_launcher`)."""
    tell_the_launcher(line)
    if print_it:
        try:
            print(line, file=sys.stderr, flush=True)
        except OSError:  # stderr on a full disk: the exit status still ends the run
            pass
    sys.exit(status)
