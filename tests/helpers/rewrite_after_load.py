"""Load a checkpoint into a trainer, then copy another file over it in place.

Usage (one rank, torchrun's variables set): rewrite_after_load.py CHECKPOINT OTHER
REPORT.json [fairseq args...]. The trainer is the one fairseq-train would build for the
arguments' --ddp-backend (fairseq's own under legacy_ddp, the plugin's under
fully_sharded). After its load_checkpoint, OTHER's bytes are copied over CHECKPOINT the way
``cp`` does (truncate, write): the report says how many optimizer-state tensors changed.
"""

from __future__ import annotations

import json
import shutil
import sys

import torch
import torch.distributed as dist
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

import fairseq_shard_plugin

fairseq_shard_plugin.activate()  # as --user-dir does
import fairseq_cli.train as train_cli  # noqa: E402  (its Trainer is hooked by activate)

from fairseq_shard_plugin.run_hooks import training_with  # noqa: E402
from fairseq_shard_plugin.sharding.settings import ShardingSettings  # noqa: E402
from fairseq_shard_plugin.training.launch_env import ensure_process_group  # noqa: E402
from fairseq_shard_plugin.training.validation import is_sharded_run  # noqa: E402


def local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def main() -> None:
    checkpoint, other, report_path, fairseq_args = (sys.argv[1], sys.argv[2], sys.argv[3],
                                                    sys.argv[4:])
    args = options.parse_args_and_arch(options.get_training_parser(), fairseq_args)
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    settings = None
    if is_sharded_run(cfg):
        ensure_process_group(cfg, False)
        settings = ShardingSettings.from_config(cfg, dist.get_world_size(), False)
    with training_with(settings):
        model = task.build_model(cfg.model)
        trainer = train_cli.Trainer(cfg, task, model, task.build_criterion(cfg.criterion))
        trainer.load_checkpoint(checkpoint)
    state = trainer.optimizer.optimizer.state
    before = [local(v).clone() for entry in state.values() for v in entry.values()
              if isinstance(v, torch.Tensor) and v.numel() > 1]
    shutil.copyfile(other, checkpoint)  # in place, as cp does
    after = [local(v) for entry in state.values() for v in entry.values()
             if isinstance(v, torch.Tensor) and v.numel() > 1]
    changed = sum(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    with open(report_path, "w") as out:
        json.dump({"trainer": type(trainer).__name__, "tensors": len(before),
                   "changed": changed}, out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
