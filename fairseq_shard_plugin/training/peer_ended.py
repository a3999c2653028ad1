"""A rank whose peer's process ended: one line instead of gloo's traceback.

When one rank stops (its own one-line error, the kernel's out-of-memory killer, a crash),
every other rank learns it inside its next collective, where gloo raises ``RuntimeError``
("Connection closed by peer ..."). That rank has nothing to report of its own: it ends
with a line that says so and points at the rank that knows why.
"""

from __future__ import annotations

from fairseq_shard_plugin.errors import error_behind
from fairseq_shard_plugin.sharding.settings import launcher_rank

# gloo's words for a peer whose process ended: its TCP connection closed or reset, or a
# write to it failing on the closed socket
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
_GLOO = "gloo/transport"  # the file in gloo's messages: a collective's connection


def peer_ended_line(error: BaseException) -> str | None:
    """The line that ends this rank when ``error`` (or what caused it) says a peer's
    process ended during a collective; None for any other error."""
    gone = error_behind(error, lambda each: isinstance(each, RuntimeError)
                        and _GLOO in str(each) and any(words in str(each)
                                                       for words in _PEER_GONE))
    if gone is None:
        return None
    rank = launcher_rank()
    return (f"fairseq-shard-plugin: error: {'' if rank is None else f'rank {rank}: '}"
            "another rank's process ended while this one waited for it in a collective "
            "(gloo: connection closed); that rank's own error, or the signal that ended it "
            "in the launcher's summary, says why")
