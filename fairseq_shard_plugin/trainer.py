"""``ShardedTrainer``: fairseq's Trainer with the plugin's sharding instead of fairscale's.

fairseq's Trainer guards its fairscale-specific code with ``is_fsdp``; this subclass turns
those branches off and overrides the few methods they served, so the rest of fairseq's
training loop (batching, logging, validation, checkpoint scheduling) runs unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from fairseq.trainer import Trainer
from torch.distributed.tensor.experimental import implicit_replication

from fairseq_shard_plugin.engines import fsdp2
from fairseq_shard_plugin.full_state import gather_full_state, shard_optimizer_state_like_params
from fairseq_shard_plugin.gradients import clip_grad_norm
from fairseq_shard_plugin.launch_env import uses_cuda
from fairseq_shard_plugin.memory import StepMemoryProbe, storage_bytes
from fairseq_shard_plugin.memory_metrics import log_step_memory
from fairseq_shard_plugin.options import sharding_options
from fairseq_shard_plugin.validation import check_sharded_config
from fairseq_shard_plugin.wrap_policy import build_plan

logger = logging.getLogger(__name__)


def ensure_process_group(use_cuda: bool) -> None:
    """A single-process run still needs a process group for FSDP: make a 1-rank one."""
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )


class ShardedTrainer(Trainer):
    """Trainer for ``--ddp-backend fully_sharded`` with the plugin loaded."""

    def __init__(self, cfg: Any, task: Any, model: Any, criterion: Any, quantizer: Any = None):
        check_sharded_config(cfg)
        self.sharding_options = sharding_options(cfg.task)
        use_cuda = uses_cuda(cfg)
        ensure_process_group(use_cuda)
        self.sharding_plan = build_plan(model, self.sharding_options.keep_root_gathered)
        mesh = fsdp2.data_parallel_mesh("cuda" if use_cuda else "cpu")
        fsdp2.apply_plan(self.sharding_plan, mesh)
        logger.info(
            "sharded %d units (%s) and the root over %d ranks with %s",
            len(self.sharding_plan.units),
            ", ".join(unit.name for unit in self.sharding_plan.units),
            dist.get_world_size(),
            self.sharding_options.shard_engine,
        )
        # Every rank reads the consolidated checkpoint itself and keeps its own slice;
        # fairseq's rank-0 broadcast would re-pickle the OmegaConf config, which
        # weights_only loading (rightly) refuses on the receiving ranks.
        cfg.checkpoint.load_checkpoint_on_all_dp_ranks = True
        super().__init__(cfg, task, model, criterion, quantizer)
        self._memory_probe = (
            None if self.sharding_options.no_memory_report else StepMemoryProbe(self.device)
        )

    # fairseq's is_fsdp branches call fairscale-only APIs (flat-parameter optimizer state,
    # DistributedFairseqModel's fairscale assertion, .cuda() in norm aggregation); each
    # thing they did is done by the overrides below instead.
    @property
    def is_fsdp(self) -> bool:
        return False

    @property
    def use_distributed_wrapper(self) -> bool:
        # FSDP reduce-scatters gradients in backward: no DDP-style wrapper around the model.
        return False

    @property
    def always_call_state_dict_during_save_checkpoint(self) -> bool:
        # Gathering full tensors for the checkpoint is a collective over all ranks.
        return True

    def clip_grad_norm(self, clip_norm: float) -> torch.Tensor:
        return clip_grad_norm(self._trainable_params(), clip_norm, self.device)

    def state_dict(self) -> dict[str, Any]:
        """A standard fairseq checkpoint: full (gathered) model and optimizer tensors."""
        return gather_full_state(super().state_dict())

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Load a full checkpoint into the sharded model: each rank keeps its own slice."""
        with implicit_replication():
            extra_state = super().load_checkpoint(*args, **kwargs)
        shard_optimizer_state_like_params(self.optimizer.optimizer)
        return extra_state

    def train_step(self, samples: Any, raise_oom: bool = False) -> Any:
        if self._memory_probe is None:
            return super().train_step(samples, raise_oom)
        self._memory_probe.start(self._resident_tensors())
        try:
            logging_output = super().train_step(samples, raise_oom)
        finally:
            step_memory = self._memory_probe.stop()
        log_step_memory(step_memory, storage_bytes(self._model_state_tensors()), self.device)
        return logging_output

    def _trainable_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.optimizer.params if p.requires_grad]

    def _resident_tensors(self) -> Iterator[torch.Tensor]:
        """Tensors alive between steps: model state and buffers."""
        for module in (self._model, self._criterion):
            yield from module.buffers()
        yield from self._model_state_tensors()

    def _model_state_tensors(self) -> Iterator[torch.Tensor]:
        """Parameters, gradients and optimizer state: what sharding divides by N."""
        for module in (self._model, self._criterion):
            yield from module.parameters()
        for param in self.optimizer.params:
            if param.grad is not None:
                yield param.grad
        for state in self.optimizer.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
