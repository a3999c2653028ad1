"""Writing the trainer's checkpoint file: gathered full state, written crash-safely."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from fairseq import utils

from fairseq_shard_plugin.atomic_files import remove_partial_files, write_atomically

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
