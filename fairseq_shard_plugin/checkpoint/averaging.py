"""The mean of several checkpoints' weights, as one export (``fairseq-shard-consolidate
--average``).

NLLB's recipe averages its last checkpoints, and fairseq's ``scripts/average_checkpoints.py``
reads every file whole with ``torch.load``: it cannot read a sharded checkpoint's index,
holds all of every input's optimizer state at once, and loads with ``weights_only=False``.
Here each source is planned as an export is (full, sharded or legacy files alike; the
optimizer state is never read), and each averaged tensor is built only when its record is
written: the peak is about one tensor of each source plus its sum.

The arithmetic is fairseq's: the tensors summed in the order the sources are given, then
divided by their number (integer tensors with floor division); fp16 and bf16 tensors are
summed in fp32, so that the mean of 16-bit weights is exported in fp32 unless ``--fp16``
or ``--bf16`` asks otherwise; a bool tensor is the first source's. Everything else (config,
training state) is the first source's, as in fairseq's script.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fairseq_shard_plugin.checkpoint.streaming_writer import LazyTensor, ResidentTensor
from fairseq_shard_plugin.errors import ShardPluginError


class AveragingError(ShardPluginError, ValueError):
    """Checkpoints whose weights cannot be averaged (other models)."""


def summed_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a mean of ``dtype`` tensors is computed and exported in: fp32 for 16-bit
    floats (fairseq's script widens fp16 too), else the tensors' own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class AveragedTensor(LazyTensor):
    """The mean of ``parts`` (same shape), as ``dtype`` (None: :func:`summed_dtype`); a
    bool tensor (a mask) is the first part's, as it has no mean."""

    def __init__(self, parts: list[LazyTensor], dtype: torch.dtype | None) -> None:
        self.parts = parts
        self.shape = tuple(parts[0].shape)
        wide = summed_dtype(parts[0].dtype)
        self.dtype = dtype if dtype is not None and wide.is_floating_point else wide

    def materialize(self) -> torch.Tensor:
        first = self.parts[0].materialize()
        if first.dtype == torch.bool:
            return first
        total = first.to(summed_dtype(first.dtype), copy=True)
        for part in self.parts[1:]:
            total += part.materialize()
        if total.is_floating_point():
            total.div_(len(self.parts))
        else:
            total //= len(self.parts)
        return total.to(self.dtype)


def _lazy(value: Any) -> Any:
    """A model entry as a :class:`LazyTensor` (a legacy file's tensors are in memory)."""
    return ResidentTensor(value) if isinstance(value, torch.Tensor) else value


def averaged_model(paths: list[Path], models: list[dict[str, Any]],
                   dtype: torch.dtype | None) -> dict[str, Any]:
    """The first model's entries, each tensor the mean of every model's (their exports'
    lazy tensors or tensors); a weight tied under several names stays one tensor."""
    first_path, first = paths[0], models[0]
    for path, model in zip(paths[1:], models[1:], strict=True):
        missing, extra = first.keys() - model.keys(), model.keys() - first.keys()
        if missing or extra:
            name = sorted(missing or extra)[0]
            holder, other = (first_path, path) if missing else (path, first_path)
            raise AveragingError(f"cannot average {first_path} and {path}: {name} is in "
                                 f"{holder} but not in {other} (another model)")
    averaged: dict[tuple[int, ...], AveragedTensor] = {}
    out: dict[str, Any] = {}
    for name, stored in first.items():
        value = _lazy(stored)
        if not isinstance(value, LazyTensor):
            out[name] = value
            continue
        parts = [value, *(_lazy(model[name]) for model in models[1:])]
        for path, part in zip(paths[1:], parts[1:], strict=True):
            problem = _mismatch(value, part)
            if problem:
                raise AveragingError(f"cannot average {first_path} and {path}: {name} "
                                     f"{problem} (another model)")
        # names tied in every source stay one tensor; tied in some only, each is averaged
        ties = tuple(id(model[name]) for model in models)
        if ties not in averaged:
            averaged[ties] = AveragedTensor(parts, dtype)
        out[name] = averaged[ties]
    return out


def _mismatch(first: LazyTensor, other: Any) -> str | None:
    """How ``other`` cannot be averaged with ``first`` (the first source's), or None."""
    if not isinstance(other, LazyTensor):
        return f"is a tensor in the first and a {type(other).__name__} in the other"
    if tuple(other.shape) != tuple(first.shape):
        return (f"has shape {list(first.shape)} in the first and {list(other.shape)} in the "
                "other")
    kinds = [("floating point" if t.dtype.is_floating_point else
              "bool" if t.dtype == torch.bool else "integer") for t in (first, other)]
    if kinds[0] != kinds[1]:
        return f"is {kinds[0]} in the first and {kinds[1]} in the other"
    return None
