"""``fairseq-shard-consolidate``: a standard fairseq checkpoint for inference.

Reads a training checkpoint of a sharded run (a save dir, meaning its
``checkpoint_last.pt``, or a checkpoint file; full or ``--checkpoint-format sharded``,
whose shards it gathers in one process), drops the optimizer state and writes the
full model weights, optionally cast to fp16/bf16, as an ordinary fairseq checkpoint that
``fairseq-generate --path`` and ``TransformerModel.from_pretrained`` load (with the plugin
as ``--user-dir``, which allows the checkpoint's config types under ``weights_only``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fairseq_shard_plugin.checkpoint.atomic_files import (
    WriteError,
    describe_os_error,
    write_atomically,
)
from fairseq_shard_plugin.checkpoint.errors import describe_unreadable
from fairseq_shard_plugin.checkpoint.integrity import corruption_message, damaged_zip_entries
from fairseq_shard_plugin.checkpoint.safe_loading import allow_fairseq_checkpoint_types
from fairseq_shard_plugin.checkpoint.sharded import (
    SHARDED_KEY,
    ShardedCheckpointError,
    fill_tensors,
    full_tensors,
    is_sharded_index,
)
from fairseq_shard_plugin.errors import ShardPluginError

_DTYPES = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}


class ConsolidateError(ShardPluginError, ValueError):
    """An input that cannot be consolidated; the message names the path and the problem."""


def resolve_checkpoint(source: str | Path) -> Path:
    """A checkpoint file, or a save dir's ``checkpoint_last.pt``."""
    path = Path(source)
    if path.is_dir():
        path = path / "checkpoint_last.pt"
    if not path.is_file():
        raise ConsolidateError(f"{path}: no such checkpoint (give a save dir or a .pt file)")
    return path


def read_full_state(path: Path) -> dict[str, Any]:
    """The checkpoint's full state (CPU tensors), read with ``weights_only=True``."""
    allow_fairseq_checkpoint_types()
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise ConsolidateError(describe_unreadable(path, error)) from error
    damaged = [] if is_sharded_index(state) else damaged_zip_entries(path)
    if damaged:
        raise ConsolidateError(corruption_message(path, damaged))
    if is_sharded_index(state):  # --checkpoint-format sharded: gather the DCP shards
        try:
            tensors = full_tensors(path, state)
        except ShardedCheckpointError as error:
            raise ConsolidateError(str(error)) from error
        state = fill_tensors({k: v for k, v in state.items() if k != SHARDED_KEY}, tensors)
    if not isinstance(state, dict) or "model" not in state or "cfg" not in state:
        raise ConsolidateError(f"{path}: not a fairseq checkpoint (no 'model' and 'cfg')")
    return state


def inference_state(state: dict[str, Any], dtype: torch.dtype | None) -> dict[str, Any]:
    """The checkpoint without optimizer state; floating weights cast to ``dtype`` if given."""
    exported = {key: value for key, value in state.items() if key != "last_optimizer_state"}
    converted: dict[tuple, torch.Tensor] = {}  # tied weights (one tensor) stay one tensor

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        key = (tensor.untyped_storage().data_ptr() or id(tensor), tensor.storage_offset(),
               tuple(tensor.shape), tensor.stride())
        if key not in converted:
            converted[key] = (tensor.to(dtype) if dtype is not None
                              and tensor.is_floating_point() else tensor).clone()
        return converted[key]

    exported["model"] = {name: convert(tensor) for name, tensor in state["model"].items()}
    return exported


def export_consolidated(
    source: str | Path, destination: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Write the inference checkpoint of ``source`` to ``destination`` (atomically)."""
    state = inference_state(read_full_state(resolve_checkpoint(source)), dtype)
    destination = Path(destination)
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise WriteError(f"could not create the directory {destination.parent}: "
                         f"{describe_os_error(error)}") from error
    write_atomically(destination, lambda out: torch.save(state, out))
    return destination
