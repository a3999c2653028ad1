"""Let ``torch.load(..., weights_only=True)`` read fairseq checkpoints, and nothing more.

Since torch 2.6, ``torch.load`` refuses any pickled class it does not know; fairseq
checkpoints store the model configuration as an ``argparse.Namespace``. The plugin
allow-lists exactly the types fairseq checkpoints need and never falls back to
``weights_only=False``, so loading a checkpoint cannot run pickled code.
"""

from __future__ import annotations

import argparse

import torch

FAIRSEQ_CHECKPOINT_TYPES: tuple[type, ...] = (argparse.Namespace,)


def allow_fairseq_checkpoint_types() -> None:
    torch.serialization.add_safe_globals(list(FAIRSEQ_CHECKPOINT_TYPES))
