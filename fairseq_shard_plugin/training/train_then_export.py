"""Hook 4's ``main``: the training, then ``--export-consolidated`` on rank 0, every rank
ending with the same line where the export failed; a stop on a signal leaves with its exit
code instead (the model is not final). The save dir stays claimed through both."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from fairseq_shard_plugin.checkpoint.atomic_files import WriteError
from fairseq_shard_plugin.checkpoint.save_dir_claim import claimed_save_dir
from fairseq_shard_plugin.errors import ShardPluginError, tell_the_launcher
from fairseq_shard_plugin.hydra_keys import as_written
from fairseq_shard_plugin.run_hooks import mark_export_follows_training, training_with
from fairseq_shard_plugin.sharding.options import sharding_options
from fairseq_shard_plugin.training.final_saves import TrainingAlreadyFinished
from fairseq_shard_plugin.training.launch_env import uses_cuda
from fairseq_shard_plugin.training.signal_stop import stopped_by

logger = logging.getLogger(__name__)


class TrainThenExport:
    """``main`` (the training), then ``--export-consolidated`` on rank 0. A class, not a
    closure: fairseq's own multi-GPU launch (``fairseq-train`` without torchrun) pickles
    ``main`` into the processes it spawns."""

    def __init__(self, main: Callable[..., Any]) -> None:
        self.main = main

    def __call__(self, cfg: Any, **kwargs: Any) -> Any:
        mark_export_follows_training()
        result = None
        settings = settings_of(cfg)
        save_dir = (contextlib.nullcontext() if cfg.checkpoint.no_save
                    or "://" in cfg.checkpoint.save_dir  # remote storage: fairseq's own
                    else claimed_save_dir(cfg.checkpoint.save_dir))
        with save_dir:  # held through the export, which reads the save dir's last save
            try:
                with training_with(settings):
                    result = self.main(cfg, **kwargs)
            except TrainingAlreadyFinished as finished:  # (every rank, at the same update)
                logger.info(as_written(str(finished), cfg))
            signum = stopped_by()
            if signum is not None:  # saved and stopped early (hook 9): not the final model
                name = signal.Signals(signum).name
                tell_the_launcher(as_written(  # torchrun's summary: a requested stop
                    f"fairseq-shard-plugin: stopped on {name} (exit code {128 + signum}) "
                    + ("without saving (--no-save)" if cfg.checkpoint.no_save else
                       "after saving checkpoint_last.pt: the same command resumes"), cfg))
                sys.exit(128 + signum)
            target = sharding_options(cfg.task).export_consolidated
            if target:
                self._export(cfg, target)
        return result

    @staticmethod
    def _export(cfg: Any, target: str) -> None:
        """Rank 0 exports; every rank learns how it went (the others waited in fairseq's
        last barrier and died there in a gloo traceback when rank 0 failed, T2 #5)."""
        failure = None
        if cfg.distributed_training.distributed_rank == 0:
            from fairseq_shard_plugin.checkpoint.consolidate import export_consolidated

            last = f"checkpoint_last{cfg.checkpoint.checkpoint_suffix}.pt"
            try:
                written = export_consolidated(os.path.join(cfg.checkpoint.save_dir, last),
                                              target)
                logger.info(f"exported the final model to {os.path.abspath(written)}")
            except ShardPluginError as error:
                failure = error
        failed = first_failure(failure)
        if failed is not None:
            raise WriteError(f"{failed} (the training itself finished: once that is fixed, "
                             "the same command exports without training)")


def settings_of(cfg: Any) -> Any:
    """The sharding settings of this rank's training (the process group joined first: a
    single process without torchrun has none yet)."""
    import torch.distributed as dist

    from fairseq_shard_plugin.sharding.settings import ShardingSettings
    from fairseq_shard_plugin.training.launch_env import ensure_process_group

    use_cuda = uses_cuda(cfg)
    ensure_process_group(cfg, use_cuda)
    return ShardingSettings.from_config(cfg, dist.get_world_size(), use_cuda)


def first_failure(failure: Exception | None) -> str | None:
    """Collective: the first failed write among every rank's (``failure`` is this rank's),
    as its message, or None when every rank's save succeeded."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None if failure is None else str(failure)
    failures: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, None if failure is None else str(failure))
    return next((text for text in failures if text is not None), None)
