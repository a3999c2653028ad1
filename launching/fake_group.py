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
    _give_reduce_scatter_outputs_values()
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


def _give_reduce_scatter_outputs_values() -> None:
    """Make the fake group's reduce-scatter write its output, as torch 2.13's does.

    torch 2.13's fake group copies the input's first slice into the output; 2.11's (the GPU
    machine's) leaves the output's memory as it was allocated, so the gradient shards held
    whatever was there before (NaN or Inf at random, and fairseq stopped the step with
    "gradients are Nan/Inf"). The copy allocates nothing: the memory measured is the same.
    """
    import inspect

    import torch
    import torch.distributed as dist

    probe = torch.zeros(1)
    dist.reduce_scatter_tensor(probe, torch.ones(dist.get_world_size()))
    if probe.item() == 1.0:  # this torch's fake group writes the output itself
        return
    collective = dist.reduce_scatter_tensor
    parameters = inspect.signature(collective)

    def reduce_scatter_tensor(*args: object, **kwargs: object) -> object:
        work = collective(*args, **kwargs)
        given = parameters.bind(*args, **kwargs).arguments
        output, tensor = given["output"], given["input"]
        output.copy_(tensor.reshape(-1)[: output.numel()].view_as(output))
        return work

    dist.reduce_scatter_tensor = reduce_scatter_tensor
