"""After a trainer loads a checkpoint, nothing it keeps may still read the file's pages.

fairseq's loader maps zip-format checkpoints (``checkpoint.reading``). The model's weights
are copied into the model, but torch's ``Optimizer.load_state_dict`` keeps the loaded
moments themselves when their dtype and device already fit, and fairseq's meters keep
what they are given. A file rewritten in place later (fairseq 0.12 copied
``checkpoint_last.pt`` so; a user's ``cp`` still does) would then change the optimizer
state under the training: NaN, or worse, wrong numbers without one.
:func:`release_checkpoint_pages` gives each such tensor memory of its own. Both the
plugin's trainer and, through integration hook 2, fairseq's own trainer under any other
``--ddp-backend`` call it at the end of ``load_checkpoint``. That subclass of fairseq's
trainer also saves a multilingual run's language list rather than its file's path.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

from fairseq.logging import metrics

from fairseq_shard_plugin.checkpoint.portable import languages_as_lists
from fairseq_shard_plugin.checkpoint.reading import private_copies_of_mapped
from fairseq_shard_plugin.run_hooks import loading_into_stock_trainer

logger = logging.getLogger(__name__)


def release_checkpoint_pages(trainer: Any) -> int:
    """Copy every mapped tensor the trainer keeps (optimizer state, meters); how many."""
    copied = 0
    optimizer = getattr(trainer, "_optimizer", None)  # fairseq builds it lazily
    if optimizer is not None:
        copied += private_copies_of_mapped(optimizer.optimizer.state)
    for name in metrics.state_dict():
        for meter in metrics.get_meters(name).values():
            copied += private_copies_of_mapped(vars(meter))
    if copied:
        logger.debug(f"{copied} loaded tensors copied out of the checkpoint file's pages")
    return copied


@functools.cache
def with_private_loaded_state(stock_trainer: type) -> type:
    """``stock_trainer`` whose ``load_checkpoint`` reads the file on every rank, takes the
    plugin's optimizer state where its layout fits (hook 6) and ends with
    :func:`release_checkpoint_pages`, and whose ``state_dict`` stores language lists."""

    class PrivateStateTrainer(stock_trainer):  # type: ignore[misc, valid-type]
        def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
            if self.data_parallel_world_size > 1:
                # every rank reads the file: rank 0's broadcast re-pickles the loaded
                # OmegaConf config, which torch >= 2.6 refuses to unpickle on the others
                self.cfg.checkpoint.load_checkpoint_on_all_dp_ranks = True
            # fairseq's signature: (filename, reset_optimizer=False, ...)
            reset = bool(args[1] if len(args) > 1 else kwargs.get("reset_optimizer", False))
            takes_state = contextlib.nullcontext() if reset else loading_into_stock_trainer(
                lambda: (self.optimizer, self.cfg.optimizer._name))
            with takes_state:
                extra_state = super().load_checkpoint(*args, **kwargs)
            release_checkpoint_pages(self)
            return extra_state

        def state_dict(self, *args: Any, **kwargs: Any) -> Any:
            """fairseq's state, its ``--langs FILE`` (or ``--lang-dict``) stored as the list
            of codes that numbered the language tokens, as the plugin's trainer saves it:
            generation and resumes check the order against it (a path is never checked)."""
            state = super().state_dict(*args, **kwargs)
            if isinstance(state, dict) and "model" not in state:  # nllb: {filename: state}
                return {name: languages_as_lists(value) for name, value in state.items()}
            return languages_as_lists(state)

    return PrivateStateTrainer
