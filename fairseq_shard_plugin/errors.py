"""The one family of errors the plugin reports: each is a :class:`ShardPluginError`.

Every error a user can cause (a configuration that cannot work, a checkpoint that cannot
be loaded or written, a step out of memory, bad estimator input) derives from it, and its
message is one line that says what to change. The training entry point
(:mod:`.fairseq_integration`, hook 4) and the console scripts catch this base once and exit
with that line; anything else is a bug and keeps its traceback. Each subclass also keeps
the built-in base its callers relied on before (``ValueError``, ``RuntimeError``,
``OSError``).
"""

from __future__ import annotations


class ShardPluginError(Exception):
    """Base of every one-line error of the plugin."""


class ShardingConfigError(ShardPluginError, ValueError):
    """A configuration the plugin cannot train; the message says what to change."""
