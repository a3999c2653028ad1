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

import sys
from types import TracebackType


class ShardPluginError(Exception):
    """Base of every one-line error of the plugin."""


class ShardingConfigError(ShardPluginError, ValueError):
    """A configuration the plugin cannot train; the message says what to change."""


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
