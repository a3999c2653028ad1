"""Let ``torch.load(..., weights_only=True)`` read fairseq checkpoints, and nothing more.

Since torch 2.6, ``torch.load`` refuses any pickled class it does not know. fairseq
checkpoints store the model configuration as an ``argparse.Namespace``, and the state of
fairseq's metrics, which holds numpy arrays when validation computes BLEU (``--eval-bleu``
logs its n-gram counts as ``np.array``). The plugin allow-lists exactly those types (numpy's
array and scalar reconstruction under the module names numpy 1 and numpy 2 pickle them
with) and never falls back to ``weights_only=False``, so loading a checkpoint cannot run
pickled code: an array's contents are raw bytes of a numeric dtype, or objects that the
same allow-list must admit.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch

try:  # numpy >= 2
    from numpy._core import multiarray
except ImportError:  # numpy 1
    from numpy.core import multiarray  # type: ignore[no-redef]

# numpy 1 pickles these as numpy.core.multiarray.*, numpy 2 as numpy._core.multiarray.*
_NUMPY_RECONSTRUCTORS = ("_reconstruct", "scalar")
# the dtypes of numeric arrays and scalars (their classes, e.g. numpy.dtypes.Int64DType)
_NUMPY_NUMERIC_TYPES = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                        np.uint32, np.uint64, np.float16, np.float32, np.float64)

FAIRSEQ_CHECKPOINT_TYPES: tuple[Any, ...] = (
    argparse.Namespace,
    np.ndarray,
    np.dtype,
    *(type(np.dtype(numeric)) for numeric in _NUMPY_NUMERIC_TYPES),
    *(
        (getattr(multiarray, name), f"{module}.multiarray.{name}")
        for name in _NUMPY_RECONSTRUCTORS
        for module in ("numpy.core", "numpy._core")
    ),
)


def allow_fairseq_checkpoint_types() -> None:
    torch.serialization.add_safe_globals(list(FAIRSEQ_CHECKPOINT_TYPES))
