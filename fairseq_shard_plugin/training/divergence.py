"""A training step whose gradients are not finite, in one line.

fairseq raises FloatingPointError when the gradient norm is NaN or Inf (fp32, bf16), or
when fp16's loss scale fell to ``--min-loss-scale`` because every scale overflowed; stock
fairseq then writes ``crash.pt`` (the plugin does not: a sharded model would have to be
gathered on the way down) and the traceback ends each rank's log (T1 #3).
"""

from __future__ import annotations

from typing import Any

from fairseq_shard_plugin.errors import ShardPluginError


class TrainingDivergedError(ShardPluginError, FloatingPointError):
    """Non-finite gradients that fairseq stops for; the message says how to go on."""


def diverged(error: FloatingPointError, cfg: Any, update: int) -> TrainingDivergedError:
    """fairseq's ``error`` in update ``update`` as one line with what to do."""
    resume = ("resume from an earlier checkpoint (fairseq-shard-verify --newest SAVE_DIR "
              "names the newest) with a lower --lr or a --clip-norm")
    if "Minimum loss scale reached" in str(error):
        return TrainingDivergedError(
            f"update {update + 1}: fp16's loss scale fell to --min-loss-scale "
            f"{cfg.common.min_loss_scale:g}, every scale overflowing: the training diverged; "
            f"{resume}, or train with --bf16, whose range needs no loss scale")
    return TrainingDivergedError(
        f"update {update + 1}: the gradients are NaN or Inf ({error}): the training diverged; "
        f"{resume}")
