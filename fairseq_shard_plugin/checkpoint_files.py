"""The trainer's checkpoint I/O: full (gathered) or sharded (DCP) state, written crash-safely."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fairseq import utils

from fairseq_shard_plugin.atomic_files import remove_partial_files, write_atomically
from fairseq_shard_plugin.checkpoint_errors import describe_shape_mismatch
from fairseq_shard_plugin.checkpoint_sharded import (
    SHARDED_KEY,
    ShardedCheckpointError,
    empty_like_saved,
    fill_tensors,
    is_sharded_index,
    load_tensors,
    read_shard_metadata,
    remove_unreferenced_shards,
    save_sharded,
    saved_shapes,
    tensor_paths,
)
from fairseq_shard_plugin.options import sharding_options

logger = logging.getLogger(__name__)


def save_full_checkpoint(trainer: Any, filename: str, extra_state: dict[str, Any]) -> str:
    """Write ``trainer.state_dict()`` plus ``extra_state`` to ``filename``; return its path.

    The caller is the rank that writes (rank 0); ``state_dict`` gathers full tensors,
    a collective the other ranks join from fairseq's ``save_checkpoint``. The file appears
    under its name only once complete (``atomic_files``), so a crash mid-write leaves the
    previous checkpoint of that name in place.
    """
    path = os.path.abspath(filename)
    logger.info(f"Saving checkpoint to {path}")
    state = utils.move_to_cpu(trainer.state_dict())
    state["extra_state"].update(extra_state)
    for leftover in remove_partial_files(os.path.dirname(path)):
        logger.warning(f"removed {leftover}, left by a save that was interrupted")
    write_atomically(path, lambda out: torch.save(state, out))
    logger.info(f"Finished saving checkpoint to {path}")
    return path


def checkpoint_state(trainer: Any, stock_state: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The trainer's checkpoint state: full tensors, or (sharded format) an index after DCP
    has written this rank's shards. A collective: every rank calls it at each save."""
    if sharding_options(trainer.cfg.task).checkpoint_format == "sharded":
        return save_sharded(stock_state(), trainer.cfg.checkpoint.save_dir,
                            trainer.get_num_updates())
    return trainer.engine.full_state(stock_state(), trainer.optimizer.optimizer)


def after_save(trainer: Any) -> None:
    """On the saving rank, once fairseq has copied and pruned names: drop orphaned shards."""
    for directory in remove_unreferenced_shards(trainer.cfg.checkpoint.save_dir, _read_index):
        logger.info(f"removed {directory}: no checkpoint refers to it any more")


def _read_index(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def read_sharded_index(filename: str) -> dict[str, Any] | None:
    """The index if ``filename`` is a readable sharded checkpoint, else None."""
    try:
        state = _read_index(Path(filename))
    except Exception:  # missing or unreadable: fairseq's own loading reports it
        return None
    return state if is_sharded_index(state) else None


def sharded_state_loader(
    trainer: Any, reset_optimizer: bool
) -> Callable[[str, dict[str, Any]], dict[str, Any]]:
    """For fairseq's loader: turn an index into a state whose tensors are this rank's shards.

    Checks names and shapes against the model first, then reads every shard into fresh
    tensors (DCP reshards to this world size); the model is touched only after all of it
    succeeded, by fairseq's own ``load_state_dict``.
    """

    def load(filename: str, index: dict[str, Any]) -> dict[str, Any]:
        entries = read_shard_metadata(filename, index)
        model_state = trainer.model.state_dict()
        shapes = {name: tuple(t.shape) for name, t in model_state.items()}
        problem = describe_shape_mismatch(filename, saved_shapes(entries, "model"), shapes)
        if problem:
            raise ShardedCheckpointError(problem)
        skeleton = {k: v for k, v in index.items() if k != SHARDED_KEY}
        if reset_optimizer:
            skeleton.pop("last_optimizer_state", None)
        params = list(trainer.optimizer.params)
        targets = {}
        for path in tensor_paths(skeleton):
            parts = path.split("/")
            like = None
            if parts[0] == "model":
                like = model_state.get(path[len("model/"):])
            elif parts[:2] == ["last_optimizer_state", "state"] and int(parts[2]) < len(params):
                like = params[int(parts[2])]
            targets[path] = empty_like_saved(entries[path], like)
        load_tensors(filename, index, targets)
        return fill_tensors(skeleton, targets)

    return load
