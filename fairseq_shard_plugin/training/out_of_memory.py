"""Stop a sharded run that ran out of memory, in one line that says what to change.

fairseq "recovers" from an out-of-memory error by dropping the batch on the rank that hit
it and carrying on (or, in validation, retrying the batch on that rank). In a sharded run
the other ranks are meanwhile inside the step's all-gathers and reduce-scatters, which the
failed rank never joins again: the job hangs until the collective times out. The plugin
asks fairseq to raise instead and turns the error into :class:`StepOutOfMemoryError`; the
launcher (torchrun, ``srun --kill-on-bad-exit``) then stops the waiting ranks.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fairseq_shard_plugin.errors import ShardPluginError
from fairseq_shard_plugin.tasks.chunked_criterion import chunked_loss_problem

logger = logging.getLogger(__name__)


class StepOutOfMemoryError(ShardPluginError, RuntimeError):
    """A rank ran out of memory in a step; the message says which and what to change."""


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's out-of-memory error, or the CPU allocator's failure to allocate."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text)


def smaller_step_advice(cfg: Any, validation: bool, model: Any = None) -> str:
    """The settings that lower a step's peak, are not on yet and that ``model`` (when
    given) can take, as flags."""
    if validation:
        tokens = cfg.dataset.max_tokens_valid or cfg.dataset.max_tokens
        return f"lower --max-tokens-valid ({tokens} now) or --batch-size-valid"
    tokens = cfg.dataset.max_tokens
    steps = [f"lower --max-tokens ({tokens} now) and raise --update-freq to keep the batch"
             if tokens else "lower --batch-size and raise --update-freq to keep the batch"]
    fsdp2 = getattr(cfg.task, "shard_engine", "fsdp2") == "fsdp2"
    if getattr(cfg.model, "checkpoint_activations", True) is False:  # absent: no such flag
        steps.append("add --checkpoint-activations")
    if (fsdp2 and getattr(cfg.criterion, "_name", None) == "label_smoothed_cross_entropy"
            and (model is None or chunked_loss_problem(model) is None)):
        steps.append("use --criterion chunked_label_smoothed_cross_entropy")
    if fsdp2 and not cfg.distributed_training.cpu_offload:
        steps.append("add --cpu-offload")
    return ", ".join(steps[:-1]) + f" or {steps[-1]}" if len(steps) > 1 else steps[0]


def _estimator_says(estimate: Callable[[], str | None] | None) -> str:
    """The estimator's clause for the error line; its generic pointer where it has none.
    Nothing the estimator raises may hide the out-of-memory error itself."""
    try:
        clause = estimate() if estimate is not None else None
    except Exception as error:  # noqa: BLE001 (the out-of-memory line comes first)
        logger.debug(f"no estimate for the out-of-memory line: {error!r}")
        clause = None
    return clause or "fairseq-shard-estimate predicts the peak of each setting"


@contextlib.contextmanager
def stop_on_out_of_memory(cfg: Any, rank: int, num_updates: int, validation: bool = False,
                          estimate: Callable[[], str | None] | None = None,
                          model: Any = None) -> Iterator[None]:
    """Turn an out-of-memory error raised inside into :class:`StepOutOfMemoryError`;
    ``estimate`` gives what fairseq-shard-estimate says of the step (training only), and
    ``model`` keeps advice it cannot take out of the line."""
    try:
        yield
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        where = (f"validation after update {num_updates}" if validation
                 else f"training update {num_updates + 1}")
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise StepOutOfMemoryError(
            f"rank {rank} ran out of memory in {where} ({first_line}); a sharded step cannot "
            f"be skipped on one rank, so training stops. To go on from the last checkpoint: "
            f"{smaller_step_advice(cfg, validation, model)}; "
            + ("fairseq-shard-estimate predicts a training step's peak" if validation
               else _estimator_says(estimate))
        ) from error
