"""Let ``torch.load(..., weights_only=True)`` read fairseq checkpoints, and nothing more.

Since torch 2.6, ``torch.load`` refuses any pickled class it does not know. fairseq
checkpoints store the model configuration as an ``argparse.Namespace``, and the state of
fairseq's metrics, which holds numpy arrays when validation computes BLEU (``--eval-bleu``
logs its n-gram counts as ``np.array``). The plugin allow-lists exactly those types (numpy's
array and scalar reconstruction under the module names numpy 1 and numpy 2 pickle them
with) and never falls back to ``weights_only=False``, so loading a checkpoint cannot run
pickled code: an array's contents are raw bytes of a numeric dtype.

``numpy.dtype`` and ``_reconstruct`` are callables a pickle may call with any argument
(``numpy.dtype('O')`` makes an object dtype without naming its class): under their
pickled names the allow-list holds versions that make numeric dtypes and arrays only, and
refuse any other as torch refuses a type outside the allow-list.
"""

from __future__ import annotations

import argparse
import pickle
from typing import Any

import numpy as np
import torch

try:  # numpy >= 2
    from numpy._core import multiarray
except ImportError:  # numpy 1
    from numpy.core import multiarray  # type: ignore[no-redef]

# the dtypes of numeric arrays and scalars (their classes, e.g. numpy.dtypes.Int64DType)
_NUMPY_NUMERIC_TYPES = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                        np.uint32, np.uint64, np.float16, np.float32, np.float64)


def _numeric_dtype(spec: Any, align: bool = False, copy: bool = False) -> np.dtype:
    """``numpy.dtype(spec, align, copy)`` for a numeric dtype's code (as numpy pickles one:
    ``'f8'``), else :class:`pickle.UnpicklingError` in the words torch refuses a type with
    (so that ``errors.describe_unreadable`` names it)."""
    try:
        dtype = np.dtype(spec, align, copy) if isinstance(spec, (str, bytes)) else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.type not in _NUMPY_NUMERIC_TYPES:
        name = "numpy.dtype" if dtype is None else (
            f"{type(dtype).__module__}.{type(dtype).__name__}")
        raise pickle.UnpicklingError(
            f"Unsupported global: GLOBAL {name} (numpy.dtype({str(spec)[:40]!r}) is not a "
            "numeric dtype)")
    return dtype


def numpy_dtype(spec: Any, align: Any = False, copy: Any = False) -> np.dtype:
    """``numpy.dtype`` as numpy pickles it (``dtype('f8', False, True)``; numpy 1 wrote the
    flags as 0 and 1), numeric only."""
    if not all(type(flag) in (bool, int) and flag in (0, 1) for flag in (align, copy)):
        raise pickle.UnpicklingError("Unsupported global: GLOBAL numpy.dtype (called with "
                                     "arguments numpy never pickles)")
    return _numeric_dtype(spec, bool(align), bool(copy))


def numpy_reconstruct(subtype: Any, shape: Any, spec: Any) -> np.ndarray:
    """numpy's ``_reconstruct`` (an empty array of ``subtype``, filled in by its state), for
    ``numpy.ndarray`` of a numeric dtype only."""
    if subtype is not np.ndarray:
        raise pickle.UnpicklingError("Unsupported global: GLOBAL numpy.ndarray (a subclass "
                                     "given to _reconstruct)")
    return multiarray._reconstruct(np.ndarray, shape, _numeric_dtype(spec))


FAIRSEQ_CHECKPOINT_TYPES: tuple[Any, ...] = (
    argparse.Namespace,
    np.ndarray,
    (numpy_dtype, "numpy.dtype"),
    *(type(np.dtype(numeric)) for numeric in _NUMPY_NUMERIC_TYPES),
    # numpy 1 pickles these as numpy.core.multiarray.*, numpy 2 as numpy._core.multiarray.*
    *((numpy_reconstruct, f"{module}.multiarray._reconstruct")
      for module in ("numpy.core", "numpy._core")),
    *((multiarray.scalar, f"{module}.multiarray.scalar") for module in ("numpy.core",
                                                                          "numpy._core")),
)


def allow_fairseq_checkpoint_types() -> None:
    torch.serialization.add_safe_globals(list(FAIRSEQ_CHECKPOINT_TYPES))
