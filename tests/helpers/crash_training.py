"""Run under torchrun in place of fairseq-train: SIGKILL every rank at a chosen save.

Usage: torchrun ... crash_training.py MODE UPDATE [fairseq-train args...]

MODE ``after-save``: once the checkpoint of update UPDATE is written, every rank waits for
the others and kills itself with SIGKILL.
MODE ``during-copy``: while the saving rank copies update UPDATE's checkpoint to
``checkpoint_last.pt``, it writes half of the bytes, then SIGKILLs every rank (itself last).

Nothing here changes what the plugin writes; the hooks only decide when the processes die.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, BinaryIO

import fairseq.checkpoint_utils as checkpoint_utils
import torch.distributed as dist

import fairseq_shard_plugin
import fairseq_shard_plugin.checkpoint.atomic_files as atomic_files

MODE, UPDATE = sys.argv[1], int(sys.argv[2])
rank_pids: list[int] = []


def kill_all_ranks() -> None:
    for pid in rank_pids:
        if pid != os.getpid():
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def save_then_maybe_die(stock_save: Any) -> Any:
    def save_checkpoint(cfg: Any, trainer: Any, epoch_itr: Any, val_loss: Any) -> Any:
        pids: list[int] = [0] * dist.get_world_size()
        dist.all_gather_object(pids, os.getpid())
        rank_pids[:] = pids
        saved = stock_save(cfg, trainer, epoch_itr, val_loss)
        if MODE == "after-save" and trainer.get_num_updates() == UPDATE:
            dist.barrier()  # the saving rank has finished writing
            os.kill(os.getpid(), signal.SIGKILL)
        return saved

    return save_checkpoint


def half_copy_then_die(stock_copy: Any) -> Any:
    def copy_file_contents(source: Path, out: BinaryIO) -> None:
        if Path(out.name).name.startswith(".checkpoint_last.pt") and (
            f"_{UPDATE}.pt" in source.name
        ):
            data = source.read_bytes()
            out.write(data[: len(data) // 2])
            out.flush()
            kill_all_ranks()
        stock_copy(source, out)

    return copy_file_contents


def main() -> None:
    if MODE == "during-copy":
        atomic_files.copy_file_contents = half_copy_then_die(atomic_files.copy_file_contents)
    # The plugin, imported later as the user dir, wraps this function in its own hook.
    checkpoint_utils.save_checkpoint = save_then_maybe_die(checkpoint_utils.save_checkpoint)
    from fairseq_cli.train import cli_main

    # the plugin's modules are imported already, so fairseq skips its user dir
    fairseq_shard_plugin.activate()

    sys.argv = ["fairseq-train", *sys.argv[3:]]
    cli_main()


if __name__ == "__main__":
    main()
