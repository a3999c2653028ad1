"""The end of a run. Saves that fairseq's own rules would skip where a checkpoint is
promised (``--export-consolidated`` exports ``checkpoint_last.pt``, and a
``--save-on-signal`` stop tells the user that the same command resumes), and no update past
``--max-update`` when a finished run's command runs again (a requeued job): fairseq checks
the limit only after each update, so it trained one more and overwrote the final
checkpoint and export with it.

- fairseq saves at the end of an epoch only every ``--save-interval`` epochs, and the end
  of ``--max-epoch`` is not a reason to save: a run of 3 epochs with ``--save-interval 2``
  ended with the epoch-2 checkpoint, which the export then wrote as "the final model";
- with ``--no-last-checkpoints`` fairseq never writes ``checkpoint_last.pt``, so a signal's
  save wrote nothing and the "resume" started from scratch.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

logger = logging.getLogger(__name__)


def ends_without_a_save(cfg: Any, trainer: Any, epoch_itr: Any, end_of_epoch: bool,
                        should_stop: bool) -> bool:
    """Whether the training ends after this update (fairseq stops it, or this is the end of
    the last epoch) and ``--export-consolidated`` waits for a checkpoint that fairseq did not
    write after it (the plugin's trainer holds the options and records the update of its
    last save; under another backend the export does not run)."""
    last_epoch = end_of_epoch and epoch_itr.epoch >= (cfg.optimization.max_epoch or math.inf)
    options = getattr(trainer, "sharding_options", None)
    if not (should_stop or last_epoch) or options is None:
        return False
    return (bool(options.export_consolidated) and not cfg.checkpoint.no_save
            and trainer.saved_at_update != trainer.get_num_updates())


def config_for_a_signal_save(checkpoint_cfg: Any) -> Any:
    """fairseq's checkpoint config for a save on a signal: ``checkpoint_last.pt`` is written
    even under ``--no-last-checkpoints`` (it is what the same command resumes from)."""
    if not checkpoint_cfg.no_last_checkpoints:
        return checkpoint_cfg
    logger.info("writing checkpoint_last.pt despite --no-last-checkpoints: the same command "
                "resumes from it")
    writes_last = copy.deepcopy(checkpoint_cfg)
    writes_last.no_last_checkpoints = False
    return writes_last


class TrainingAlreadyFinished(Exception):
    """The checkpoint resumed from is at ``--max-update``: nothing is left to train."""


def refuse_a_step_past_the_end(cfg: Any, num_updates: int) -> None:
    """Before an update: raise :class:`TrainingAlreadyFinished` where the run has reached
    ``--max-update`` already (only a resumed finished run gets here)."""
    max_update = cfg.optimization.max_update
    if max_update and num_updates >= max_update:
        raise TrainingAlreadyFinished(
            f"the checkpoint resumed from is at update {num_updates}, --max-update "
            f"{max_update}: nothing left to train (raise --max-update to train on)")
