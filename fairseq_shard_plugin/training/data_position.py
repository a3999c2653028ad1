"""Keep a resumed training's place in its epoch when the number of ranks changes.

fairseq records the position in the epoch as ``iterations_in_epoch``: batches drawn by
*each* rank, which deals the epoch's batches out round-robin to the data-parallel ranks.
Resumed on another number of ranks, that per-rank count means something else: 2 -> 4 ranks
would skip half of the batches already due, 4 -> 2 would see half of the trained ones
again, and a position past the smaller per-rank share makes fairseq stop with "Cannot
resume training due to dataloader mismatch". The trainer records the number of ranks next
to fairseq's iterator state at every save and converts the position on load, so that the
same batches of the epoch count as done (rounded down: at most one batch per rank is
trained again when the counts do not divide).
"""

from __future__ import annotations

from typing import Any

SAVED_RANKS = "data_parallel_ranks"


def record_ranks(extra_state: dict[str, Any], ranks: int) -> None:
    """Note the number of data-parallel ranks beside the iterator state being saved."""
    iterator = extra_state.get("train_iterator")
    if isinstance(iterator, dict):
        iterator[SAVED_RANKS] = ranks


def convert_position(extra_state: dict[str, Any] | None, ranks: int) -> str | None:
    """Rewrite a loaded iterator state saved on another number of ranks for ``ranks``;
    return a line saying what changed, or None when nothing had to."""
    iterator = (extra_state or {}).get("train_iterator")
    if not isinstance(iterator, dict) or SAVED_RANKS not in iterator:
        return None  # saved by stock fairseq: its position is used as it is
    saved = int(iterator[SAVED_RANKS])
    position = int(iterator.get("iterations_in_epoch", 0))
    iterator[SAVED_RANKS] = ranks
    if saved == ranks or position == 0:
        return None
    iterator["iterations_in_epoch"] = position * saved // ranks
    return (
        f"checkpoint saved on {saved} ranks, resumed on {ranks}: epoch {iterator.get('epoch')} "
        f"continues after {position * saved} of its batches ({position} per rank then, "
        f"{iterator['iterations_in_epoch']} per rank now)"
    )
