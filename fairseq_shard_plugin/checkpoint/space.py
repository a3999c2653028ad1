"""Say early whether the save dir can hold this run's checkpoints.

A full disk otherwise shows at the first save, which may come hours into a run. Once the
first update has created the optimizer state, the saving rank logs how large a checkpoint
of this run is and how much space the save dir has, and warns when the first save or the
one after it will not fit.
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fairseq_shard_plugin.checkpoint.sharded import split_tensors


def saves_in_copies(checkpoint_format: str, checkpoint_cfg: Any = None) -> tuple[int, int]:
    """(what the first save writes, what the next one adds while the first one's files
    stay), in checkpoint sizes. Sharded: one set of shards each (fairseq's names are small
    indexes of it; the next set is written before the previous one may be removed). Full:
    the first name, then copies to checkpoint_last.pt and (when validation improves)
    checkpoint_best.pt; the next save adds the epoch or interval file fairseq keeps
    (none under --no-epoch-checkpoints without --save-interval-updates) and the temporary
    copy that replaces checkpoint_last.pt or checkpoint_best.pt."""
    if checkpoint_format == "sharded":
        return 1, 1
    kept = bool(not getattr(checkpoint_cfg, "no_epoch_checkpoints", False)
                or getattr(checkpoint_cfg, "save_interval_updates", 0))
    last = not getattr(checkpoint_cfg, "no_last_checkpoints", False)
    return int(kept) + int(last) + 1, int(kept) + 1


# What DCP writes per chunk (one rank's piece of one tensor) beside its bytes: torch.save's
# record of it in the .distcp file (~1.54 KiB) and its entry in .metadata (~0.19 KiB),
# measured with dcp.save of 100 and 400 tensors (1,723-1,736 bytes a tensor). Negligible at
# NLLB sizes, most of a tiny model's sharded checkpoint.
DCP_BYTES_PER_CHUNK = 1750


def full_state_bytes(
    params_and_states: Iterable[tuple[torch.Tensor, torch.Tensor, dict]], shard_group: int,
    checkpoint_format: str = "full",
) -> int:
    """Bytes of a checkpoint of the parameters and optimizer state, from (parameter, the
    local tensor the optimizer updates, its optimizer state) triples; a parameter that is
    not a DTensor (fairscale's flat shards) counts as ``shard_group`` times its local size.
    The full format stores 16-bit tensors as fp32 (4 bytes an element, as fairseq writes
    them); the sharded one keeps their size and adds DCP's bytes per chunk."""
    widened = checkpoint_format == "full"

    def size(tensor: torch.Tensor) -> int:
        sixteen = tensor.dtype in (torch.float16, torch.bfloat16)
        return tensor.numel() * (4 if widened and sixteen else tensor.element_size())

    total = 0
    for param, local, state in params_and_states:
        if isinstance(param, DTensor):
            factor = param.numel() / max(local.numel(), 1)
        else:
            factor = shard_group
        tensors = [local, *(v for v in state.values()
                            if isinstance(v, torch.Tensor) and v.numel() == local.numel())]
        total += int(sum(size(t) for t in tensors) * factor)
        if not widened:
            total += DCP_BYTES_PER_CHUNK * len(tensors) * shard_group
    return total


def structure_bytes(state: Any, checkpoint_format: str = "full") -> int:
    """Bytes of a checkpoint of ``state`` besides the tensors :func:`full_state_bytes`
    counts, measured by ``torch.save`` of ``state`` with each tensor a one-element one
    (shared where the tensor was): the pickle (config, names, meters, the optimizer
    state's layout; ~32 KiB at any size) and, in the full format, one zip record per
    stored tensor (local header, central directory entry with its name twice, padding to
    64 bytes: ~190 bytes); 12% of a d-32, 1+1-layer model's full checkpoint, 27% at d 16.
    In the sharded format: the index file, and DCP's bytes per chunk for the meters'
    scalar tensors."""
    placeholders: dict[int, torch.Tensor] = {}

    def placeholder(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in placeholders:
                placeholders[id(value)] = torch.zeros(1, dtype=value.dtype)
            return placeholders[id(value)]
        if isinstance(value, dict):
            return {key: placeholder(entry) for key, entry in value.items()}
        if isinstance(value, (list, tuple)):
            return [placeholder(entry) for entry in value]
        return value

    skeleton = placeholder(state)
    scalars = 0
    if checkpoint_format == "sharded":  # tensors as references, as the index holds them
        skeleton, tensors = split_tensors(skeleton)
        scalars = sum(1 for where in tensors if where.startswith("extra_state/"))
    written = io.BytesIO()
    torch.save(skeleton, written)
    return written.tell() + DCP_BYTES_PER_CHUNK * scalars


def readable(size: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size / 1024:.1f} KiB"


def free_space(directory: str) -> int:
    """Free bytes on the file system of ``directory``, or of its nearest existing parent
    (fairseq creates the save dir later)."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def space_report(save_dir: str, checkpoint_bytes: int, checkpoint_format: str,
                 free_bytes: int | None = None,
                 checkpoint_cfg: Any = None) -> tuple[str, bool]:
    """(the line to log, whether it is a warning: the first save or the next would not fit),
    for the names ``checkpoint_cfg`` (fairseq's) keeps (:func:`saves_in_copies`)."""
    free = free_space(save_dir) if free_bytes is None else free_bytes
    first, next_adds = saves_in_copies(checkpoint_format, checkpoint_cfg)
    needed = checkpoint_bytes * first
    stored = "fp32 " if checkpoint_format == "full" else ""  # sharded: as trained
    line = (f"checkpoints of this run: about {readable(checkpoint_bytes)} each "
            f"({stored}model and optimizer state, --checkpoint-format {checkpoint_format}); "
            f"{readable(free)} free in {save_dir}")
    if free < needed:
        copies = (" (the checkpoint, then copies to checkpoint_last.pt and checkpoint_best.pt; "
                  "--checkpoint-format sharded writes it once)"
                  if checkpoint_format == "full" else "")
        return (f"{line}, but a save writes up to {readable(needed)}{copies}: it will fail; "
                "free space or pass another --save-dir"), True
    next_needs = checkpoint_bytes * next_adds
    if free >= needed + next_needs:
        return line, False
    why = ("its shards, before the previous save's may be removed"
           if checkpoint_format == "sharded" else
           "a new checkpoint file and a temporary copy for checkpoint_last.pt" if next_adds > 1
           else "a temporary copy for checkpoint_last.pt")
    return (f"{line}: room for one save, but the next one adds up to {readable(next_needs)} "
            f"({why}) and will fail; free space or pass another --save-dir"), True
