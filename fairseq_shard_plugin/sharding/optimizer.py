"""The sharded run's optimizer: fairseq's, or the plugin's Adam where fairseq has none.

fairseq builds its optimizer from ``--optimizer``; the plugin gives it the plain local
shards (:mod:`.local_shards`) and wraps it for loss scaling and deferred clipping
(:class:`.precision.ShardedMasterOptimizer`). For ``--optimizer adam`` the update runs in
:class:`.sharded_adam.ShardedAdam` instead of fairseq's implementation when

- the parameters are 16-bit (``--memory-efficient-fp16/bf16``): fp32 arithmetic over them,
  with the loss scale applied in fp32;
- ``--fp16-adam-stats`` asks for 16-bit moments, which fairseq implements only with apex
  on CUDA (elsewhere it raises NotImplementedError);
- ``--cpu-offload`` steps on the host, where the plugin's C step is the fastest measured
  for 16-bit state and as fast as torch's fused CPU kernel for fp32 (``benchmarks/host_adam.py``),
  and runs behind the next forward (:mod:`.host_step_overlap`);
  apex's FusedAdam, fairseq's choice whenever CUDA and apex exist, cannot step CPU state;
- FSDP2's shards are on a GPU: fairseq itself steps with a fused Adam there (apex's) unless
  ``--use-old-adam``, and so does the plugin (torch's multi-tensor fused kernel, a few
  launches per step instead of about ten per parameter tensor; fairseq's update within a
  rounding); ``--use-old-adam`` keeps fairseq's own Adam, bit for bit. (The fairscale
  engine's flat shards are a few tensors: fairseq's Adam is cheap there.)

Otherwise (CPU ranks with fp32 state) fairseq's own optimizer runs unchanged, so those runs
update exactly as stock fairseq does.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from fairseq import optim
from omegaconf import open_dict

from fairseq_shard_plugin.errors import ShardingConfigError
from fairseq_shard_plugin.sharding.local_shards import LocalShards
from fairseq_shard_plugin.sharding.precision import ShardedMasterOptimizer, fp16_loss_scaler
from fairseq_shard_plugin.sharding.settings import ShardingSettings
from fairseq_shard_plugin.sharding.sharded_adam import MaxOverRanks, ShardedAdam

logger = logging.getLogger(__name__)


# fairseq says these cannot step one flat tensor, but their state is per element (Adagrad's
# sum of squared gradients): a shard's update is the unsharded update of its elements
ELEMENT_WISE_WITHOUT_FLAT_PARAMS = frozenset({"adagrad"})


# fairseq's other optimizers whose sharded state is exact, as the refusals name them
OTHER_ELEMENT_WISE = "sgd, nag, adadelta, adamax or adagrad"


def _steps_element_wise(fairseq_optimizer: Any, name: str) -> bool:
    """Whether fairseq's optimizer ``name`` updates each element on its own (a shard's
    update is then the unsharded update of its elements)."""
    return fairseq_optimizer.supports_flat_params or name in ELEMENT_WISE_WITHOUT_FLAT_PARAMS


def is_element_wise(optimizer_cfg: Any) -> bool:
    """:func:`_steps_element_wise` for ``--optimizer``, asked of its optimizer over a
    stand-in parameter (before the model is built)."""
    stand_in = optim.build_optimizer(optimizer_cfg, [torch.zeros(1, requires_grad=True)])
    return _steps_element_wise(stand_in, optimizer_cfg._name)


def not_element_wise(name: str, sixteen_bit: str | None = None) -> ShardingConfigError:
    """The refusal of ``--optimizer name``, with the optimizers that work instead (with
    ``--memory-efficient-{sixteen_bit}`` where given: adam alone keeps 16-bit shards)."""
    others = OTHER_ELEMENT_WISE
    advice = (f"adam (fairseq's is AdamW) with --memory-efficient-{sixteen_bit}, or {others} "
              f"with --{sixteen_bit} (fp32 master shards)" if sixteen_bit else
              f"adam (fairseq's is AdamW), {others}")
    error = ShardingConfigError(
        f"--optimizer {name} is not element-wise, so its sharded state would differ from "
        f"unsharded training: use {advice} with --ddp-backend fully_sharded")
    error.node_wide = True  # the configuration's: every rank refuses it alike
    return error


def fp16_adam_stats(optimizer_cfg: Any) -> bool:
    """Whether ``--fp16-adam-stats`` is set (an option of fairseq's Adam only)."""
    return optimizer_cfg._name == "adam" and bool(optimizer_cfg.get("fp16_adam_stats"))


def uses_sharded_adam(optimizer_cfg: Any, settings: ShardingSettings) -> bool:
    """Whether the update runs in :class:`ShardedAdam` (see the module's docstring)."""
    on_gpu = (settings.engine == "fsdp2" and settings.device_type == "cuda"
              and not optimizer_cfg.get("use_old_adam"))
    return optimizer_cfg._name == "adam" and (
        settings.sixteen_bit_parameters or settings.offload or fp16_adam_stats(optimizer_cfg)
        or on_gpu)


def _fairseq_optimizer_config(optimizer_cfg: Any, own_adam: bool) -> Any:
    """fairseq's config, with Adam's apex-only choices turned off when the plugin's Adam
    replaces the update (fairseq would refuse ``--fp16-adam-stats`` without apex)."""
    if not own_adam:
        return optimizer_cfg
    optimizer_cfg = copy.deepcopy(optimizer_cfg)
    with open_dict(optimizer_cfg):
        optimizer_cfg.use_old_adam = True
        optimizer_cfg.fp16_adam_stats = False
    return optimizer_cfg


def build_sharded_optimizer(cfg: Any, params: list[torch.Tensor], settings: ShardingSettings,
                            max_over_ranks: MaxOverRanks | None) -> ShardedMasterOptimizer:
    """fairseq's optimizer over the local shards of ``params``, wrapped for scaling and
    clipping; ``max_over_ranks`` reduces 16-bit moments' scales across ranks."""
    shards = LocalShards(params)
    own_adam = uses_sharded_adam(cfg.optimizer, settings)
    fairseq_optimizer = optim.build_optimizer(
        _fairseq_optimizer_config(cfg.optimizer, own_adam), shards.locals)
    if not _steps_element_wise(fairseq_optimizer, cfg.optimizer._name):
        raise not_element_wise(cfg.optimizer._name)
    if own_adam:
        fp16_moments = fp16_adam_stats(cfg.optimizer)
        # chosen for speed alone (fp32 masters on GPUs), or because fairseq's cannot step
        needs_own_adam = settings.sixteen_bit_parameters or settings.offload or fp16_moments
        fairseq_optimizer.optimizer = ShardedAdam(
            shards.locals, **fairseq_optimizer.optimizer_config, fp16_moments=fp16_moments,
            max_over_ranks=max_over_ranks)
        logger.info(
            "Adam steps with the plugin's fused implementation: %s parameters, %s moments%s",
            "16-bit" if settings.sixteen_bit_parameters else "fp32",
            "fp16 (scaled)" if fp16_moments else "fp32",
            ", on the host" if settings.offload else (
                " (--use-old-adam: fairseq's)" if not needs_own_adam else ""))
    scaler = fp16_loss_scaler(cfg) if settings.compute_dtype == torch.float16 else None
    return ShardedMasterOptimizer(cfg, fairseq_optimizer, scaler, shards)
