"""What the trainer and the hooks of :mod:`.fairseq_integration` tell each other.

The hooks import the trainer (to construct it); the trainer must not import the hooks, so
the little state they share lives here, below every subpackage (it imports none): the
loader that fairseq's checkpoint reading hands every checkpoint to while the trainer loads
one (hook 6), whether the ``--export-consolidated`` export follows the training in this
process (hook 4), the sharding settings of the training being built (hooks 1 and 4), and
what hook 6 read of the checkpoint fairseq read last (language list, tensor shapes), which
its task checks as it builds the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

TrainerLoader = Callable[[str, dict[str, Any]], dict[str, Any]]
_trainer_loaders: list[TrainerLoader] = []
_stock_optimizers: list[Callable[[], Any]] = []
_export_follows_main = False
_settings_of_training: list[Any] = []
_checkpoint_read: list[CheckpointRead | None] = [None]


@dataclasses.dataclass(frozen=True)
class CheckpointRead:
    """What a task checks of the checkpoint fairseq has just read (hook 6), as it builds
    that checkpoint's model next: the language list that numbered its language tokens
    (None where the checkpoint does not say), the shapes of its model's tensors and its
    language-token options."""

    path: str
    languages: Any
    shapes: dict[str, tuple[int, ...]]
    language_tokens: tuple[Any, bool] | None = None  # --encoder-langtok, --decoder-langtok


def note_checkpoint_read(read: CheckpointRead) -> None:
    """Note what hook 6 read of the checkpoint fairseq has just loaded."""
    _checkpoint_read[0] = read


def checkpoint_read() -> CheckpointRead | None:
    """What fairseq read last (:func:`note_checkpoint_read`), or None."""
    return _checkpoint_read[0]


@contextlib.contextmanager
def training_with(settings: Any) -> Iterator[None]:
    """While fairseq's ``main`` runs (hook 4): the run's
    :class:`~fairseq_shard_plugin.sharding.settings.ShardingSettings`, by which hook 1
    shards each layer as fairseq builds it."""
    _settings_of_training.append(settings)
    try:
        yield
    finally:
        _settings_of_training.pop()


def settings_of_training() -> Any:
    """The sharding settings of the training running in this process, or None."""
    return _settings_of_training[-1] if _settings_of_training else None


@contextlib.contextmanager
def loading_into_trainer(loader: TrainerLoader) -> Iterator[None]:
    """While active, every checkpoint read through fairseq is passed to ``loader`` (the
    sharded trainer's: resolves sharded indexes collectively into this rank's shards and
    adopts stock optimizer state) before fairseq's Trainer sees it (hook 6)."""
    _trainer_loaders.append(loader)
    try:
        yield
    finally:
        _trainer_loaders.pop()


@contextlib.contextmanager
def loading_into_stock_trainer(optimizer: Callable[[], Any]) -> Iterator[None]:
    """While fairseq's own trainer (any other ``--ddp-backend``, hook 2) loads a checkpoint
    with its optimizer state: ``optimizer`` gives the optimizer it resumes and its
    ``--optimizer`` name, which hook 6 compares with a checkpoint the plugin's optimizer
    saved."""
    _stock_optimizers.append(optimizer)
    try:
        yield
    finally:
        _stock_optimizers.pop()


def stock_trainer_optimizer() -> Callable[[], Any] | None:
    """:func:`loading_into_stock_trainer`'s ``optimizer``, or None."""
    return _stock_optimizers[-1] if _stock_optimizers else None


def active_trainer_loader() -> TrainerLoader | None:
    """The loader of the trainer loading a checkpoint now, if any."""
    return _trainer_loaders[-1] if _trainer_loaders else None


def mark_export_follows_training() -> None:
    global _export_follows_main
    _export_follows_main = True


def export_follows_training() -> bool:
    """True when this process's training runs inside hook 4, which does the
    ``--export-consolidated`` export afterwards (not so when ``fairseq-hydra-train``
    imported the plugin only from ``common.user_dir``: see ``hydra_callback``)."""
    return _export_follows_main
