"""A sharded trainer for N ranks in one process, on a fake process group."""

from __future__ import annotations


def trainer_on_fake_group(fairseq_args: list[str], world_size: int) -> object:
    """The plugin's ShardedTrainer for ``fairseq_args`` on a fake process group of
    ``world_size`` ranks in this process (initialised here)."""
    import torch
    import torch.distributed as dist
    from fairseq import options as fairseq_options
    from fairseq import tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fairseq_shard_plugin

    fairseq_shard_plugin.activate()  # as --user-dir does
    from fairseq_shard_plugin.sharding.precision import untie_bf16_from_tpu
    from fairseq_shard_plugin.training.trainer import ShardedTrainer

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    args = fairseq_options.parse_args_and_arch(fairseq_options.get_training_parser(),
                                               fairseq_args)
    cfg = convert_namespace_to_omegaconf(args)
    untie_bf16_from_tpu(cfg)  # as fairseq-train does with the plugin loaded
    cfg.distributed_training.distributed_world_size = world_size
    cfg.distributed_training.distributed_init_method = "fake://in-process"  # group exists
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    model = task.build_model(cfg.model)
    return ShardedTrainer(cfg, task, model, task.build_criterion(cfg.criterion))
