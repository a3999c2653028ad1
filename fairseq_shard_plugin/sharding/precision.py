"""Mixed precision for sharded training: 16-bit compute, fp32 or 16-bit shards, loss scaling.

FSDP casts the gathered copies to the compute dtype for forward and backward and reduces
gradients in fp32 (16-bit reduction on request). What the shards hold follows fairseq's
flags (:func:`.settings.sixteen_bit_parameters`):

- ``--fp16``/``--bf16``: fp32 master shards and fp32 gradient shards; no persistent 16-bit
  copy exists;
- ``--memory-efficient-fp16/bf16``: the shards themselves are 16-bit (parameters and
  gradients), updated with fp32 arithmetic (:mod:`.sharded_adam`), as fairseq's
  memory-efficient optimizers do.

Sharded model state per parameter, divided by the ranks: fp32 or ``--fp16`` 16 bytes
(parameter, gradient, two Adam moments); ``--memory-efficient-fp16`` 12, as fairseq's;
with ``--fp16-adam-stats`` (moments in scaled fp16) 8, as Meta's NLLB recipe, or 12 with
fp32 masters. fp16 uses fairseq's dynamic loss scaler with its flags; bf16 needs no
scaling.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from fairseq.optim import FairseqOptimizer
from fairseq.optim.dynamic_loss_scaler import DynamicLossScaler
from torch.distributed.fsdp import MixedPrecisionPolicy

from fairseq_shard_plugin.errors import ShardingConfigError
from fairseq_shard_plugin.sharding.local_shards import LocalShards
from fairseq_shard_plugin.sharding.sharded_adam import ShardedAdam, with_fp32_moments

logger = logging.getLogger(__name__)


def mixed_precision_policy(
    dtype: torch.dtype | None, reduce_in_16_bit: bool
) -> MixedPrecisionPolicy:
    """FSDP2's policy: gathered copies in ``dtype`` (None: fp32, no cast), gradients
    reduce-scattered in fp32 unless ``reduce_in_16_bit``."""
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=dtype if reduce_in_16_bit else torch.float32
    )


def cast_buffers(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Floating-point buffers in the compute type, as fairseq's ``model.half()`` leaves them."""
    for submodule in module.modules():
        for name, buffer in submodule.named_buffers(recurse=False):
            if buffer.is_floating_point():
                setattr(submodule, name, buffer.to(dtype))


# fairseq saves only the loss scale of its DynamicLossScaler; when the scale next grows or
# shrinks depends on these counters too (steps since the last overflow and rescale), so a
# resume that restarts them from zero changes the run from the next window on
SCALER_COUNTERS = ("_iter", "_last_overflow_iter", "_last_rescale_iter",
                   "_overflows_since_rescale")
SCALER_COUNTERS_KEY = "loss_scaler_counters"


def fp16_loss_scaler(cfg: Any) -> DynamicLossScaler:
    """fairseq's dynamic loss scaler, configured from the same flags as its fp16 optimizers."""
    common = cfg.common
    window = common.fp16_scale_window
    if window is None:
        if len(cfg.optimization.update_freq) > 1:
            raise ShardingConfigError(
                f"--update-freq {','.join(map(str, cfg.optimization.update_freq))} is a "
                "schedule: give --fp16-scale-window N with it (fairseq derives the loss "
                "scale's window from a single --update-freq)")
        ranks = cfg.distributed_training.distributed_world_size
        window = int(2**14 / ranks / cfg.optimization.update_freq[0])
    return DynamicLossScaler(
        init_scale=common.fp16_init_scale,
        scale_window=window,
        tolerance=common.fp16_scale_tolerance,
        threshold=common.threshold_loss_scale,
        min_loss_scale=common.min_loss_scale,
    )


class ShardedMasterOptimizer(FairseqOptimizer):
    """Wraps fairseq's optimizer over the shards with scaling and deferred clipping.

    Gradients are never rescaled in place until :meth:`step`: loss scale, fairseq's
    ``multiply_grads`` and clipping accumulate into one factor, applied once. On overflow
    (a non-finite global norm, the same on every rank) the step is skipped, parameters and
    optimizer state stay bit-identical, and the scaler lowers the scale.

    With ``shards`` the wrapped optimizer was built over ``shards.locals`` (plain tensors on
    the parameters' local shards, see :mod:`.local_shards`): ``params`` still yields the
    model's (DTensor) parameters, and :meth:`state_dict` / :meth:`load_state_dict` still
    speak DTensors sharded like them.
    """

    def __init__(
        self, cfg: Any, fp32_optimizer: FairseqOptimizer, scaler: DynamicLossScaler | None,
        shards: LocalShards | None = None,
    ) -> None:
        super().__init__(cfg.optimizer)
        self.fp32_optimizer = fp32_optimizer
        self.scaler = scaler
        self.shards = shards
        self.skipped_step = False
        self._grad_factor = self._initial_factor()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.fp32_optimizer.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.fp32_optimizer.optimizer = optimizer

    @property
    def optimizer_config(self) -> dict[str, Any]:
        return self.fp32_optimizer.optimizer_config

    @property
    def params(self) -> Iterator[torch.Tensor]:
        """The model's parameters (DTensors when sharded), not their local stand-ins."""
        yield from self.shards.params if self.shards is not None else self.fp32_optimizer.params

    def _initial_factor(self) -> float:
        return 1.0 / self.scaler.loss_scale if self.scaler is not None else 1.0

    def state_dict(self) -> dict[str, Any]:
        state = self.fp32_optimizer.state_dict()
        if self.shards is not None:
            state = self.shards.sharded_state(state, self.optimizer)
        if self.scaler is not None:
            state["loss_scale"] = self.scaler.loss_scale
            state[SCALER_COUNTERS_KEY] = {name: getattr(self.scaler, name)
                                          for name in SCALER_COUNTERS}
        return state

    def load_state_dict(self, state_dict: dict[str, Any], optimizer_overrides: Any = None) -> None:
        state_dict = dict(state_dict)
        loss_scale = state_dict.pop("loss_scale", None)
        counters = state_dict.pop(SCALER_COUNTERS_KEY, None)
        if loss_scale is not None and self.scaler is not None:
            self.scaler.loss_scale = loss_scale
        if isinstance(counters, dict) and self.scaler is not None:
            for name in SCALER_COUNTERS:
                if name in counters:
                    setattr(self.scaler, name, int(counters[name]))
        if self.shards is not None:
            state_dict = self.shards.local_state(state_dict, self.optimizer)
        if not isinstance(self.optimizer, ShardedAdam):  # moments of a --fp16-adam-stats run
            state_dict = with_fp32_moments(state_dict)
        self.fp32_optimizer.load_state_dict(state_dict, optimizer_overrides)
        self._grad_factor = self._initial_factor()

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def multiply_grads(self, c: Any) -> None:
        self._grad_factor *= float(c)

    def apply_norm(self, stored_grad_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
        """Given the global norm of the stored gradients, return the true norm.

        Records clipping in the deferred factor, or an overflow (the step is then skipped).
        """
        norm = stored_grad_norm * self._grad_factor
        if not torch.isfinite(norm):
            if self.scaler is None:
                return norm  # fp32/bf16: fairseq's trainer reports non-finite gradients
            try:  # lowers the scale, or raises FloatingPointError at --min-loss-scale
                self.scaler.check_overflow(float("inf"))
            except OverflowError:
                # fairseq's Trainer handles this exception with a .cuda() call; the step
                # is skipped here instead, and set_num_updates does not count it.
                logger.info("gradient overflow: skipping this update, loss scale is now %s",
                            self.scaler.loss_scale)
            self.skipped_step = True
            return torch.zeros_like(norm)
        if max_norm > 0 and float(norm) > max_norm:
            self._grad_factor *= max_norm / (float(norm) + 1e-6)
        return norm

    def step(self, closure: Any = None, scale: float = 1.0, groups: Any = None) -> None:
        if self.skipped_step:
            self.zero_grad()
            return
        factor = self._grad_factor / scale
        if isinstance(self.optimizer, ShardedAdam):  # the factor applied in fp32, in the step
            if self.shards is not None:
                self.shards.bind()
            self.optimizer.step(closure, grad_factor=factor)
        elif self.shards is not None:
            grads = self.shards.bind()
            if factor != 1.0 and grads:
                torch._foreach_mul_(grads, factor)
            self.fp32_optimizer.step(closure, groups=groups)
        else:
            if factor != 1.0:
                for param in self.params:
                    if param.grad is not None:
                        param.grad.mul_(factor)
            self.fp32_optimizer.step(closure, groups=groups)
        if self.scaler is not None:
            self.scaler.update()
        self._grad_factor = self._initial_factor()

    def zero_grad(self) -> None:
        if self.shards is not None:
            self.shards.zero_grad()
        self.fp32_optimizer.zero_grad()
        self._grad_factor = self._initial_factor()

    def take_skipped_step(self) -> bool:
        """Whether the last step was skipped for overflow; clears the flag."""
        skipped, self.skipped_step = self.skipped_step, False
        return skipped


def untie_bf16_from_tpu(cfg: Any) -> None:
    """fairseq's argument parser turns ``--bf16`` into ``--tpu`` (bf16 used to mean TPUs);
    sharded bf16 runs on CPUs and GPUs, so that implied flag is dropped again."""
    if cfg.common.bf16 and cfg.common.tpu:
        cfg.common.tpu = False
        cfg.distributed_training.tpu = False
