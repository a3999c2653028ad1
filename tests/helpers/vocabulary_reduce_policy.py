"""Print, as JSON, the reduce dtype FSDP2 uses per unit under --reduce-vocabulary-in-16-bit.

Runs in one process on a fake process group of world size 2 (no values are exchanged).
Arguments: DATA, then fairseq training flags.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from torch.testing._internal.distributed.fake_pg import FakeStore

import fairseq_shard_plugin  # noqa: F401  (registers the plugin, as --user-dir does)
from fairseq_shard_plugin.precision import untie_bf16_from_tpu
from fairseq_shard_plugin.trainer import ShardedTrainer

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
args = options.parse_args_and_arch(options.get_training_parser(), sys.argv[1:])
cfg = convert_namespace_to_omegaconf(args)
untie_bf16_from_tpu(cfg)
cfg.distributed_training.distributed_world_size = 2
cfg.distributed_training.distributed_init_method = "fake://in-process"
task = tasks.setup_task(cfg.task)
model = task.build_model(cfg.model)
trainer = ShardedTrainer(cfg, task, model, task.build_criterion(cfg.criterion))
report = {}
for unit in trainer.sharding_plan.units:
    policy = unit.modules[0]._get_fsdp_state()._mp_policy
    report[unit.name] = str(policy.reduce_dtype)
print(json.dumps(report))
