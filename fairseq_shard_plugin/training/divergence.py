"""A training step whose gradients are not finite, in one line.

fairseq raises FloatingPointError when the gradient norm is NaN or Inf (fp32, bf16), or
when fp16's loss scale fell to ``--min-loss-scale`` because every scale overflowed; stock
fairseq then writes ``crash.pt`` (the plugin does not: a sharded model would have to be
gathered on the way down) and the traceback ends each rank's log (T1 #3).
"""

from __future__ import annotations

import glob
import os
from typing import Any

from fairseq_shard_plugin.errors import ShardPluginError


class TrainingDivergedError(ShardPluginError, FloatingPointError):
    """Non-finite gradients that fairseq stops for; the message says how to go on."""


def diverged(error: FloatingPointError, cfg: Any, update: int) -> TrainingDivergedError:
    """fairseq's ``error`` in update ``update`` as one line with what to do."""
    save_dir = cfg.checkpoint.save_dir
    if glob.glob(os.path.join(glob.escape(save_dir), "checkpoint*.pt")):
        resume = (f"resume from an earlier checkpoint (fairseq-shard-verify --newest "
                  f"{save_dir} names the newest) with a lower --lr or a --clip-norm")
    else:
        resume = "no checkpoint was saved yet: start again with a lower --lr or a --clip-norm"
    if "Minimum loss scale reached" in str(error):
        return TrainingDivergedError(
            f"update {update + 1}: fp16's loss scale fell from --fp16-init-scale "
            f"{cfg.common.fp16_init_scale:g} to --min-loss-scale "
            f"{cfg.common.min_loss_scale:g}, every scale overflowing (diverged, or the two "
            f"are close together); {resume}, or train with --bf16, whose range needs no "
            "loss scale")
    said = str(error).strip()
    cause = "" if said.lower() == "gradients are nan/inf" else f" ({said})"
    return TrainingDivergedError(
        f"update {update + 1}: the gradients are NaN or Inf{cause}: the training diverged; "
        f"{resume}")
