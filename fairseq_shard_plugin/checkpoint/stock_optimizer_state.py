"""Resume the optimizer state of checkpoints written without the plugin.

fairseq refuses optimizer state saved under another optimizer class name ("Optimizer does
not match"). The plugin's :class:`~fairseq_shard_plugin.sharding.precision.ShardedMasterOptimizer`
saves exactly what stock fairseq saves for fp32 runs (the wrapped optimizer's state, one
entry per parameter) and for ``--memory-efficient-fp16`` runs (the same plus
``loss_scale``), so such checkpoints are relabelled and resumed with their moments. State
whose layout differs (stock ``--fp16`` keeps one flattened fp32 copy of all parameters)
is refused in one line that says to add ``--reset-optimizer``. The other way round, a
checkpoint of the plugin resumed under another ``--ddp-backend`` (fairseq's own trainer
and optimizer) is relabelled for it where the layout fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fairseq_shard_plugin.checkpoint.errors import CheckpointLoadError

# the plugin's optimizer (sharding.precision.ShardedMasterOptimizer), as checkpoints name it
PLUGINS = "ShardedMasterOptimizer"
# fairseq's 16-bit wrappers whose state is the wrapped optimizer's (+ loss_scale)
STOCK_WRAPPERS = ("FP16Optimizer", "MemoryEfficientFP16Optimizer")


class StockOptimizerStateError(CheckpointLoadError):
    """Stock optimizer state the sharded optimizer cannot take; the message says what to do."""


def layout_problem(saved: dict[str, Any], shapes: Sequence[torch.Size]) -> str | None:
    """Why per-parameter state ``saved`` does not fit parameters of ``shapes``, or None."""
    groups = saved.get("param_groups") or []
    listed = [group["params"] for group in groups
              if isinstance(group, dict) and isinstance(group.get("params"), list)]
    counted = sum(len(params) for params in listed)
    if listed and len(listed) == len(groups) and counted != len(shapes):
        # (torch's load_state_dict would refuse it, unexplained)
        return f"state for {counted} parameters, {len(shapes)} in this model"
    for index, entry in saved.get("state", {}).items():
        if not isinstance(index, int) or not 0 <= index < len(shapes):
            return f"state for parameter {index!r} of {len(shapes)}"
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and (
                    tuple(value.shape) != tuple(shapes[index])):
                return (f"{key} of parameter {index} has shape {list(value.shape)}, the "
                        f"parameter {list(shapes[index])}")
    return None


def adopt_stock_optimizer_state(
    filename: str, state: dict[str, Any], ours: str, inner: str,
    parameter_shapes: Sequence[torch.Size],
) -> None:
    """Relabel ``state``'s last optimizer entry as ``ours`` if its state fits, in place.

    ``ours`` is the class name of the trainer's sharded optimizer, ``inner`` that of the
    optimizer it wraps (e.g. ``FairseqAdam``); ``parameter_shapes`` are the full shapes of
    its parameters, in order.
    """
    history = state.get("optimizer_history") or [{}]
    saved_name = history[-1].get("optimizer_name")
    if "last_optimizer_state" not in state or saved_name in (None, ours):
        return
    if saved_name not in (inner, *STOCK_WRAPPERS):
        raise StockOptimizerStateError(
            f"{filename}: its optimizer state was saved by {saved_name}, this run uses "
            f"{inner}; add --reset-optimizer to start the optimizer afresh")
    problem = layout_problem(state["last_optimizer_state"], parameter_shapes)
    if problem:
        raise StockOptimizerStateError(
            f"{filename}: its {saved_name} state does not match this model's parameters one "
            f"by one ({problem}; stock --fp16 flattens them); add --reset-optimizer to start "
            "the optimizer afresh")
    history[-1]["optimizer_name"] = ours


def give_to_stock_optimizer(filename: str, state: dict[str, Any], optimizer: Any,
                            optimizer_name: str) -> None:
    """Relabel ``state``'s last optimizer entry, saved by the plugin's optimizer, for
    fairseq's own ``optimizer`` (a run resumed under another ``--ddp-backend``) where it
    wrapped the same ``--optimizer`` (``optimizer_name``) and its per-parameter state fits,
    in place; refuse it in one line where only the layout differs (stock ``--fp16`` keeps
    one flat fp32 copy). Another ``--optimizer`` is left to fairseq's own refusal."""
    history = state.get("optimizer_history") or [{}]
    if "last_optimizer_state" not in state or history[-1].get("optimizer_name") != PLUGINS:
        return
    cfg = state.get("cfg")
    saved = cfg.get("optimizer") if hasattr(cfg, "get") else None
    if not hasattr(saved, "get") or saved.get("_name") != optimizer_name:
        return
    stock = type(optimizer).__name__
    problem = layout_problem(state["last_optimizer_state"],
                             [parameter.shape for parameter in optimizer.params])
    if problem:
        raise StockOptimizerStateError(
            f"{filename}: its optimizer state (the plugin's, one entry per parameter) does "
            f"not fit fairseq's {stock} ({problem}); add --reset-optimizer to start the "
            "optimizer afresh, or resume with --ddp-backend fully_sharded")
    history[-1]["optimizer_name"] = stock
