"""Run under torchrun: load checkpoints into fresh ShardedTrainers on this world size.

Usage: torchrun ... reshard_checkpoints.py REPORT.json SPEC.json [fairseq args...]

SPEC holds ``exact`` (checkpoints, full or sharded, whose gathered model and optimizer
state must equal the file's), ``broken`` (checkpoints that must fail with one line and
change nothing), ``other_arch`` (extra fairseq args for a second model that must refuse
``exact[0]``, and ``exact[1]`` where given), ``other_vocab`` (a data directory whose
dictionary differs, for a model that must refuse ``exact[0]``) and ``write`` (where to
save the last exact checkpoint again, from this world size). The reference for "equal" is
the file read in one process (``consolidate.read_full_state``, which gathers sharded
checkpoints itself).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from process_group import leave_process_group
from sharded_setup import build_trainer

import fairseq_shard_plugin
from fairseq_shard_plugin.checkpoint.consolidate import read_full_state
from fairseq_shard_plugin.checkpoint.errors import CheckpointLoadError
from fairseq_shard_plugin.sharding.full_state import gather_full_state
from fairseq_shard_plugin.training.trainer import ShardedTrainer

fairseq_shard_plugin.activate()  # as --user-dir does


def gathered(trainer: ShardedTrainer) -> tuple[dict[str, Any], dict[str, Any]]:
    return (gather_full_state(trainer.model.state_dict()),
            gather_full_state(trainer.optimizer.state_dict()))


def equal_state(trainer: ShardedTrainer, checkpoint: str) -> dict[str, Any]:
    saved = read_full_state(Path(checkpoint))
    model, optimizer = gathered(trainer)
    saved_optimizer = saved["last_optimizer_state"]
    tensors = [(key, value, saved_optimizer["state"][index][key])
               for index, state in optimizer["state"].items()
               for key, value in state.items() if isinstance(value, torch.Tensor)]
    return {
        "checkpoint": checkpoint,
        "model_equal": model.keys() == saved["model"].keys() and all(
            torch.equal(model[name], saved["model"][name]) for name in model),
        "optimizer_tensors": len(tensors),
        "optimizer_equal": len(optimizer["state"]) == len(saved_optimizer["state"]) and all(
            torch.equal(value, reference) for _, value, reference in tensors),
        "num_updates": trainer.get_num_updates(),
        "saved_num_updates": saved["optimizer_history"][-1]["num_updates"],
    }


def refused(trainer: ShardedTrainer, checkpoint: str) -> dict[str, Any]:
    """Load a bad checkpoint: record the error and whether any state changed."""
    before = gathered(trainer)
    try:
        trainer.load_checkpoint(checkpoint)
        message = None
    except CheckpointLoadError as error:
        message = str(error)
    after = gathered(trainer)
    unchanged = all(torch.equal(before[0][k], after[0][k]) for k in before[0]) and (
        before[1]["state"].keys() == after[1]["state"].keys())
    return {"checkpoint": checkpoint, "error": message, "unchanged": unchanged}


def main() -> None:
    report_path, spec = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    fairseq_args = sys.argv[3:]
    trainer, _, _ = build_trainer(fairseq_args)
    report: dict[str, Any] = {"world_size": dist.get_world_size(), "exact": [], "broken": []}
    for checkpoint in spec.get("broken", []):
        report["broken"].append(refused(trainer, checkpoint))
    if spec.get("other_arch"):
        other, _, _ = build_trainer(fairseq_args + spec["other_arch"])
        report["other_arch"] = refused(other, spec["exact"][0])
        if len(spec["exact"]) > 1:  # a full checkpoint (its optimizer state misfits too)
            report["other_arch_full"] = refused(other, spec["exact"][1])
    if spec.get("other_vocab"):
        other, _, _ = build_trainer([spec["other_vocab"], *fairseq_args[1:]])
        report["other_vocab"] = refused(other, spec["exact"][0])
    extra_state = None
    for checkpoint in spec.get("exact", []):
        extra_state = trainer.load_checkpoint(checkpoint)
        report["exact"].append(equal_state(trainer, checkpoint))
    if spec.get("write"):  # the steps of fairseq's checkpoint_utils.save_checkpoint
        trainer.consolidate_optimizer()
        if dist.get_rank() == 0:
            iterator = {"train_iterator": extra_state["train_iterator"]}
            trainer.save_checkpoint(spec["write"], iterator)
        else:
            trainer.state_dict()  # the collective part of the save, as fairseq does
    if dist.get_rank() == 0:
        Path(report_path).write_text(json.dumps(report))
    leave_process_group()


if __name__ == "__main__":
    main()
