"""Read a checkpoint file of either torch format, mapped where it can be, and make sure
nothing kept after a load still reads the file's pages.

``torch.save`` has written zip archives since torch 1.6; older files (and
``_use_new_zipfile_serialization=False``) are one pickle stream, the *legacy* format.
:func:`read_checkpoint` maps a zip file (``mmap=True``: its pages are page cache, shared
by every rank of a host) and reads a legacy one, always with ``weights_only=True``.

A mapped tensor stays backed by the file: copying another file over it in place (as
``cp`` and ``shutil.copyfile`` do, and fairseq's ``PathManager.copy`` did for
``checkpoint_last.pt``) changes, or truncates under it, whatever has not been written to
since. Model weights are copied into the model by every fairseq loader, so mapping them is
safe and saves a private copy per rank; what a trainer *keeps* (optimizer state, meters)
must not stay mapped. :func:`private_copies_of_mapped` replaces each tensor that lies in a
file this process mapped by a copy of its own; the trainers call it after every load.

A checkpoint's containers are data from anyone: the pickle memo lets 60 lists of 1 KB
share each other into 2**60 paths, or nest 300,000 deep. :func:`read_checkpoint` refuses
structures no fairseq checkpoint has (:func:`check_structure`) before anything walks them
(the plugin's walks, and fairseq's, follow every path).
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

# Address ranges [start, end) of the files this process has mapped through read_checkpoint.
# Ranges are never forgotten: an address reused after a mapping is gone costs one needless
# copy, never a missed one.
_MAPPED_RANGES: list[tuple[int, int]] = []
_LOCK = threading.Lock()

# The two magic numbers torch.save writes first: a zip archive's, and the legacy format's
# pickle header (protocol 2 by default; ``pickle_protocol=`` may have chosen 3 to 5).
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGICS = tuple(bytes([0x80, protocol]) for protocol in range(2, 6))


# A fairseq checkpoint nests its containers fewer than 20 deep and holds thousands of
# entries (a few hundred thousand for the largest models' optimizer state).
MAX_NESTING = 100
MAX_ENTRIES = 10_000_000


class NotACheckpointError(ValueError):
    """A file in neither of torch's formats (its first bytes are wrong)."""


class CheckpointStructureError(NotACheckpointError):
    """A readable file whose containers no fairseq checkpoint has: nested too deep, too
    many entries along every path (shared lists), or a container inside itself."""


def checkpoint_format(path: str | Path) -> str:
    """``"zip"``, ``"legacy"``, or :class:`NotACheckpointError` naming what the file is."""
    with open(path, "rb") as stream:
        head = stream.read(4)
    if head == _ZIP_MAGIC:  # a truncated archive too: torch's reader then says what is wrong
        return "zip"
    if head[:2] in _LEGACY_MAGICS:
        return "legacy"
    shown = "is empty" if not head else f"starts with bytes {head.hex()}"
    raise NotACheckpointError(
        f"not a PyTorch checkpoint: the file {shown}, neither a zip archive (torch.save "
        "since torch 1.6) nor the legacy pickle format")


def _parts(value: Any) -> Iterable[Any] | None:
    """What a container holds (a dict's keys and values, a Namespace's attributes); None
    for anything else."""
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, dict):
        return (*value.keys(), *value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return value
    return None


def _refused(what: str) -> CheckpointStructureError:
    return CheckpointStructureError(
        f"refused: it holds {what}, which no fairseq checkpoint does (a crafted or damaged "
        "file?); re-save the checkpoint without it where it was written")


def check_structure(state: Any, parts_of: Callable[[Any], Iterable[Any] | None] = _parts,
                    max_nesting: int = MAX_NESTING, max_entries: int = MAX_ENTRIES) -> None:
    """:class:`CheckpointStructureError` unless ``state``'s containers nest at most
    ``max_nesting`` deep, hold at most ``max_entries`` entries counted along every path (a
    shared list once per reference) and none contains itself. ``parts_of`` says what a
    container holds (None for a value that is none; it may raise the error itself for a
    value it refuses). Each container is measured once, so a crafted file costs time
    linear in its size."""
    measured: dict[int, tuple[int, int]] = {}  # id -> (entries along every path, height)
    open_now: set[int] = set()

    def measure(value: Any, depth: int) -> tuple[int, int]:
        parts = parts_of(value)
        if parts is None:
            return 1, 0
        known = measured.get(id(value))
        if known is None:
            if id(value) in open_now:
                raise _refused("a list or dict that contains itself")
            if depth >= max_nesting:
                raise _refused(f"lists or dicts nested more than {max_nesting} deep")
            open_now.add(id(value))
            entries, height = 1, 0
            for part in parts:
                size, below = measure(part, depth + 1)
                entries, height = entries + size, max(height, below + 1)
                if entries > max_entries:
                    raise _refused(f"more than {max_entries:,} entries counted along every "
                                   "path (lists shared by reference, say)")
            open_now.discard(id(value))
            known = measured[id(value)] = entries, height
        if depth + known[1] > max_nesting:
            raise _refused(f"lists or dicts nested more than {max_nesting} deep")
        return known

    measure(state, 0)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``'s containers, each container visited once."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (dict, list, tuple)) and id(item) not in seen:
            seen.add(id(item))
            pending.extend(item.values() if isinstance(item, dict) else item)
    return found


def _remember_mapping(state: Any) -> None:
    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
             for t in _tensors(state) if t.device.type == "cpu"]
    spans = [(start, start + size) for start, size in spans if size]
    if spans:
        with _LOCK:
            _MAPPED_RANGES.append((min(s for s, _ in spans), max(e for _, e in spans)))


def read_checkpoint(path: str | Path, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``: mapped for a zip file, read for a legacy one.

    Raises :class:`NotACheckpointError` for a file of neither format,
    :class:`CheckpointStructureError` for containers no checkpoint has, and torch's own
    error (a refused type, a damaged archive) otherwise."""
    mapped = checkpoint_format(path) == "zip"
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mapped)
    except RecursionError as error:
        raise _refused(f"containers nested too deep to read ({MAX_NESTING} at most)") \
            from error
    check_structure(state)
    if mapped:
        _remember_mapping(state)
    return state


def is_mapped(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory lies in a file :func:`read_checkpoint` mapped."""
    if tensor.device.type != "cpu" or tensor.untyped_storage().nbytes() == 0:
        return False
    address = tensor.untyped_storage().data_ptr()
    with _LOCK:
        return any(start <= address < end for start, end in _MAPPED_RANGES)


def private_copies_of_mapped(container: Any) -> int:
    """Replace, in place, every mapped tensor held in ``container`` (nested dicts and
    lists, e.g. an optimizer's ``state``) by a copy of its own; returns how many."""
    replaced = 0
    seen: set[int] = set()  # containers already fixed (one shared by several holds)

    def fix(value: Any, store: Callable[[Any], None]) -> None:
        nonlocal replaced
        if isinstance(value, torch.Tensor):
            if is_mapped(value):
                store(value.clone())
                replaced += 1
        elif id(value) in seen:
            return
        elif isinstance(value, dict):
            seen.add(id(value))
            for key, entry in list(value.items()):
                fix(entry, lambda new, key=key: value.__setitem__(key, new))
        elif isinstance(value, list):
            seen.add(id(value))
            for index, entry in enumerate(value):
                fix(entry, lambda new, index=index: value.__setitem__(index, new))

    fix(container, lambda new: None)
    return replaced
