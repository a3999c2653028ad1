"""Build a real fairseq task, model and ShardedTrainer on torchrun ranks, for test helpers."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

import fairseq_shard_plugin
from fairseq_shard_plugin.training.trainer import ShardedTrainer

fairseq_shard_plugin.activate()  # as --user-dir does


def build_trainer(fairseq_args: list[str]) -> tuple[ShardedTrainer, Any, dict[str, torch.Tensor]]:
    """Return the trainer, the task, and the model's full parameters before sharding."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    args = options.parse_args_and_arch(options.get_training_parser(), fairseq_args)
    cfg = convert_namespace_to_omegaconf(args)
    cfg.distributed_training.distributed_world_size = dist.get_world_size()
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    model = task.build_model(cfg.model)
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = ShardedTrainer(cfg, task, model, task.build_criterion(cfg.criterion))
    return trainer, task, full
