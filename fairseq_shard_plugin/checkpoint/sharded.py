"""Sharded checkpoints (``--checkpoint-format sharded``) with torch.distributed.checkpoint.

A sharded checkpoint is two things:

* a directory ``SAVE_DIR/checkpoint_shards/u<updates>-<id>/`` written by
  ``torch.distributed.checkpoint`` (DCP): every rank writes only its own shards of the
  model, the fp32 masters' optimizer state (Adam moments) and any other tensor;
* an *index* under fairseq's usual names (``checkpoint_1_20.pt``, ``checkpoint_last.pt``,
  ...): an ordinary small fairseq checkpoint file in which every tensor is replaced by a
  reference ``{"__shard__": path}`` and ``"sharded_checkpoint"`` names the directory. It
  keeps everything else fairseq stores (config, lr scheduler, data iterator position,
  loss scale, meters), so fairseq's own logic (``--restore-file``, ``--reset-*``,
  ``--keep-interval-updates``, ``checkpoint_last``/``best`` copies) works on it unchanged.

The index is written, atomically, only after DCP has finished the directory (its
``.metadata`` is written last), so a crash never leaves an index pointing at an
incomplete directory; directories no index refers to are deleted after each save
(:func:`remove_unreferenced_shards`), but only those the plugin created and marked as its
own for this save dir: ``checkpoint_shards/`` may be a symlink to a scratch disk that holds
other things, and other save dirs' shards.
DCP reshards on load, so a checkpoint written on N ranks loads on any other number of
ranks.

Reading one runs no code from it: the index is read with ``weights_only=True``, its shard
directory must be one of ``checkpoint_shards/`` beside it (:func:`shard_directory`), and
DCP's ``.metadata`` is unpickled only through an allow-list (``shard_metadata``).
"""

from __future__ import annotations

import logging
import re
import shutil
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from fairseq_shard_plugin.checkpoint.atomic_files import (
    WriteError,
    describe_os_error,
    describe_write_failure,
)
from fairseq_shard_plugin.checkpoint.integrity import (
    RESUME_HINT,
    corruption_message,
    mismatched_shard_files,
    shard_checksums,
)
from fairseq_shard_plugin.checkpoint.reading import NotACheckpointError, checkpoint_format
from fairseq_shard_plugin.checkpoint.shard_metadata import SafeFileSystemReader, UnsafeMetadataError
from fairseq_shard_plugin.errors import ShardPluginError

SHARDED_KEY = "sharded_checkpoint"
SHARDS_DIR = "checkpoint_shards"
_REF = "__shard__"
# The file by which cleanup recognises a shard directory as the plugin's own, and its text.
MARKER = ".fairseq-shard-plugin"
MARKER_HEADER = "shard directory written by fairseq_shard_plugin:"
_SHARD_DIR_NAME = re.compile(r"u[0-9]+-[0-9a-f]+")

logger = logging.getLogger(__name__)


class ShardedCheckpointError(ShardPluginError, RuntimeError):
    """A sharded checkpoint that cannot be used; the message names the file and the problem."""


# ---------------------------------------------------------------- state <-> (skeleton, tensors)


def split_tensors(state: Any, path: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Replace every tensor in a nested state by ``{"__shard__": path}``; return both parts.

    A tensor object found again (a tied weight under its other names) refers to the path
    where it was first found, so it is written once."""
    tensors: dict[str, torch.Tensor] = {}
    first_path: dict[int, str] = {}
    skeletons: dict[int, Any] = {}  # a container held in several places is split once

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) in first_path:
                return {_REF: first_path[id(value)]}
            first_path[id(value)] = where
            tensors[where] = value
            return {_REF: where}
        if not isinstance(value, (dict, list, tuple)):
            return value
        if id(value) not in skeletons:
            if isinstance(value, dict):
                skeletons[id(value)] = type(value)(
                    (k, walk(v, f"{where}/{k}" if where else str(k))) for k, v in value.items())
            else:
                skeletons[id(value)] = type(value)(walk(v, f"{where}/{i}")
                                                   for i, v in enumerate(value))
        return skeletons[id(value)]

    return walk(state, path), tensors


def _reference(value: dict, where: str | Path) -> str | None:
    """The tensor path ``value`` refers to (``{"__shard__": path}``), else None; a
    reference by anything but a path is refused."""
    if set(value) != {_REF}:
        return None
    path = value[_REF]
    if not isinstance(path, str):
        raise ShardedCheckpointError(
            f"{where}: refers to a tensor by a {type(path).__name__}, not by its path (a "
            "damaged or crafted index?); refused: use an intact checkpoint")
    return path


def fill_tensors(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_tensors` (a container held in several places filled once)."""
    filled: dict[int, Any] = {}

    def walk(value: Any) -> Any:
        if not isinstance(value, (dict, list, tuple)):
            return value
        if id(value) not in filled:
            if isinstance(value, dict):
                path = _reference(value, "the index")
                filled[id(value)] = tensors[path] if path is not None else type(value)(
                    (k, walk(v)) for k, v in value.items())
            else:
                filled[id(value)] = type(value)(walk(v) for v in value)
        return filled[id(value)]

    return walk(skeleton)


def tensor_paths(skeleton: Any, where: str | Path = "the index") -> list[str]:
    """The paths a skeleton (of the index file ``where``) refers to, each once (a tied
    weight's names share one), in order of first reference; each container is visited
    once."""
    found: dict[str, None] = {}
    seen: set[int] = set()

    def walk(value: Any) -> None:
        if not isinstance(value, (dict, list, tuple)) or id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, dict):
            path = _reference(value, where)
            if path is not None:
                found[path] = None
                return
        for v in value.values() if isinstance(value, dict) else value:
            walk(v)

    walk(skeleton)
    return list(found)


def is_sharded_index(state: Any) -> bool:
    return isinstance(state, dict) and SHARDED_KEY in state


# ---------------------------------------------------------------- saving


def _marker_text(name: str, save_dir: Path | None) -> str:
    """The marker of shard directory ``name`` written for ``save_dir`` (resolved); None:
    the marker of releases before 2026-12-05, which named no save dir."""
    owner = "" if save_dir is None else f"save dir: {save_dir}\n"
    return f"{MARKER_HEADER} {name}\n{owner}"


def _new_shard_dir(save_dir: Path, num_updates: int) -> str:
    """A fresh directory, created and marked as the plugin's by rank 0 (before any shard
    is written, so that even an interrupted save's directory is recognised), its name
    agreed on by all ranks. A directory rank 0 cannot create stops every rank with one
    :class:`WriteError`."""
    name = f"{SHARDS_DIR}/u{num_updates}-{time.time_ns():x}"
    failure = ""
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            mark_as_shard_directory(save_dir / name, save_dir)
        except OSError as error:
            failure = (f"could not create the shard directory {save_dir / name} for update "
                       f"{num_updates}: {describe_os_error(error)}; the checkpoints saved "
                       "before are unchanged")
    agreed = [name, failure]
    if dist.is_initialized():
        dist.broadcast_object_list(agreed, src=0)
    if agreed[1]:
        raise WriteError(agreed[1])
    return agreed[0]


def mark_as_shard_directory(directory: Path, save_dir: Path) -> None:
    """Create ``directory`` (if need be) with the marker that makes it the plugin's own,
    for the checkpoints of ``save_dir``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).write_text(_marker_text(directory.name, Path(save_dir).resolve()))


def shared_with(index_file: Path, index: dict[str, Any]) -> Path | None:
    """The other save dir whose runs may remove the index's shard directory: the one its
    marker names, where that save dir still exists and its ``checkpoint_shards`` is the
    same directory as this one's (a save dir copied with its ``checkpoint_shards`` link,
    ``cp -a``). None where the shards are this save dir's own, or unmarked."""
    directory = shard_directory(index_file, index)
    try:
        lines = (directory / MARKER).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    owner = next((Path(line.split(": ", 1)[1]) for line in lines[1:2]
                  if line.startswith("save dir: ")), None)
    here = Path(index_file).resolve().parent
    if owner is None or owner.resolve() == here or not owner.is_dir():  # (moved, with a
        return None  # link left at the old name: the same save dir)
    return owner if (owner / SHARDS_DIR).resolve() == directory.parent else None


def is_plugin_shard_directory(directory: Path, save_dir: Path) -> bool:
    """Whether ``directory`` is a shard directory the plugin created for ``save_dir``: a
    real directory (not a symlink) named ``u<updates>-<hex>`` that holds the plugin's marker
    file for that name and save dir. Several save dirs may keep their shards in one scratch
    directory (``checkpoint_shards`` as a symlink): each cleans up only its own. Markers of
    earlier releases name no save dir: they count only in a ``checkpoint_shards`` that is a
    real directory of ``save_dir``. Cleanup deletes nothing else."""
    marker = directory / MARKER
    if (directory.is_symlink() or not directory.is_dir() or not _SHARD_DIR_NAME.fullmatch(
            directory.name) or marker.is_symlink() or not marker.is_file()):
        return False
    save_dir = Path(save_dir)
    accepted = {_marker_text(directory.name, save_dir.resolve())}
    if not (save_dir / SHARDS_DIR).is_symlink():
        accepted.add(_marker_text(directory.name, None))
    try:
        return marker.read_text() in accepted
    except (OSError, UnicodeDecodeError):
        return False


def save_sharded(state: dict[str, Any], save_dir: str | Path, num_updates: int) -> dict:
    """Collective: write the tensors of ``state`` with DCP; return the index (no tensors)."""
    save_dir = Path(save_dir)
    skeleton, tensors = split_tensors(state)
    relative = _new_shard_dir(save_dir, num_updates)
    try:
        dcp.save(tensors, checkpoint_id=save_dir / relative)
    except (Exception, CheckpointException) as error:  # (a BaseException) on every rank
        cause = describe_write_failure(error)
        if cause is None:
            raise
        shutil.rmtree(save_dir / relative, ignore_errors=True)  # no index refers to it yet
        raise WriteError(
            f"could not write the shards of update {num_updates} to {save_dir / relative}: "
            f"{cause}; removed them, the checkpoints saved before are unchanged") from error
    skeleton[SHARDED_KEY] = {
        "dir": relative,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "version": 1,
        "crc32": shard_checksums(save_dir / relative),
    }
    return skeleton


def _possible_indexes(save_dir: Path) -> list[Path]:
    """The files of ``save_dir`` that may be checkpoints, hence refer to shards: fairseq's
    names (``*.pt``), copies beside them (``*.pt.*``) whose first bytes may be a torch
    file's, and any other file torch.save wrote (an index set aside as ``update2.ckpt``,
    perhaps to restore it later); not a checksum, notes, logs or other archives."""
    return sorted(path for path in save_dir.iterdir() if not path.name.startswith(".")
                  and path.is_file() and (path.name.endswith(".pt")
                                          or (".pt." in path.name and _may_be_torch_file(path))
                                          or _is_torch_archive(path)))


def _may_be_torch_file(path: Path) -> bool:
    """False only for a file whose first bytes are neither of torch's formats; an empty
    file (a copy just begun) or one that cannot be opened may still become or be one."""
    try:
        return path.stat().st_size == 0 or bool(checkpoint_format(path))
    except NotACheckpointError:
        return False
    except OSError:
        return True


# how torch.save's legacy format begins: protocol 2, then its magic number as a long
_LEGACY_TORCH_START = bytes.fromhex("80028a0a6cfc9c46f9206aa85019")


def _is_torch_archive(path: Path) -> bool:
    """Whether ``path`` is a file as torch.save writes it (a zip holding ``<name>/data.pkl``,
    or the legacy format's magic number): an index set aside under any name. Other archives
    (``.npz``, ``logs.zip``) and TorchScript's (``<name>/code/``) are not."""
    try:
        with open(path, "rb") as stream:
            if stream.read(len(_LEGACY_TORCH_START)) == _LEGACY_TORCH_START:
                return True
        if not zipfile.is_zipfile(path):
            return False
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return False
    return (any(name.count("/") == 1 and name.endswith("/data.pkl") for name in names)
            and not any("/code/" in name for name in names))


def remove_unreferenced_shards(
    save_dir: str | Path, read_index: Callable[[Path], Any], also_kept: Path | None = None
) -> list[Path]:
    """Delete the plugin's shard directories (:func:`is_plugin_shard_directory`) in
    ``save_dir/checkpoint_shards`` that no checkpoint file in ``save_dir`` refers to
    (``*.pt``, and files of any other name that begin as torch files do, such as
    ``checkpoint_last.pt.bak``; a checksum or a log is not one).

    ``checkpoint_shards`` itself may be a symlink (shards on a scratch disk): its entries
    are listed through it, and only the directories the plugin wrote for this save dir
    among them are candidates (another save dir may share the scratch directory).
    A checkpoint that cannot be read might refer to any of them: then nothing is deleted,
    and a warning names the file. ``also_kept``: a directory referred to from elsewhere (the
    index a run was restored from, outside the save dir)."""
    save_dir = Path(save_dir)
    shards = save_dir / SHARDS_DIR
    if not shards.is_dir():
        return []
    referenced = {also_kept.resolve()} if also_kept is not None else set()
    for checkpoint in _possible_indexes(save_dir):
        try:
            index = read_index(checkpoint)
            if is_sharded_index(index):
                referenced.add(shard_directory(checkpoint, index))
        except Exception as error:  # it may refer to any directory: keep them all
            logger.warning(f"kept every shard directory in {shards}: {checkpoint} could not be "
                           f"read ({type(error).__name__}: {str(error)[:200]}), so which one "
                           "it refers to is unknown")
            return []
    removed = []
    for directory in sorted(shards.iterdir()):
        if (is_plugin_shard_directory(directory, save_dir)
                and directory.resolve() not in referenced):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


# ---------------------------------------------------------------- loading


def shard_directory(index_file: str | Path, index: dict[str, Any]) -> Path:
    """The DCP directory of an index, resolved next to the index file.

    It must be a directory of ``checkpoint_shards/`` beside the index file (symlinks
    resolved), as :func:`save_sharded` names them; any other, e.g. ``../elsewhere`` or an
    absolute path, is refused."""
    entry = index.get(SHARDED_KEY)
    relative = entry.get("dir") if isinstance(entry, dict) else None
    if not isinstance(relative, str) or not relative or "\0" in relative:
        raise ShardedCheckpointError(
            f"{index_file}: its {SHARDED_KEY} entry names no shard directory")
    save_dir = Path(index_file).resolve().parent
    directory = (save_dir / relative).resolve()
    if directory.parent != (save_dir / SHARDS_DIR).resolve():
        shown = relative if relative.isprintable() else repr(relative)
        raise ShardedCheckpointError(
            f"{index_file}: refusing its shard directory {shown[:200]}: it resolves to "
            f"{directory}, not to a directory of {save_dir / SHARDS_DIR}")
    return directory


def read_shard_metadata(
    index_file: str | Path, index: dict[str, Any], collective: bool = False
) -> dict[str, Any]:
    """DCP's metadata of every tensor path in the index; one-line errors if unusable.

    Shard files are checked against the CRC-32 recorded at save time (indexes written
    before checksums existed have none); ``collective`` splits that work among the ranks,
    which must all call it.
    """
    directory = shard_directory(index_file, index)
    paths = tensor_paths(index, index_file)
    checksums = index[SHARDED_KEY].get("crc32") or {}
    strays = [name for name in checksums
              if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..")]
    if strays:
        raise ShardedCheckpointError(
            f"{index_file}: its checksums name {str(strays[0])[:200]!r}, not a file of its "
            "shard directory")
    if not directory.is_dir():
        raise ShardedCheckpointError(
            f"{index_file}: its shard directory {directory} is missing (the file is the index "
            f"of a sharded checkpoint, whose tensors stay in {SHARDS_DIR}/ beside it: a copy "
            f"of the file alone needs {directory.parent.name}/{directory.name} copied beside "
            "it too, or export one standard file with fairseq-shard-consolidate from where it "
            f"was saved); {RESUME_HINT}"
        )
    try:
        metadata = SafeFileSystemReader(directory).read_metadata()
    except UnsafeMetadataError as error:
        raise ShardedCheckpointError(f"{index_file}: {error}") from error
    except Exception as error:
        raise ShardedCheckpointError(
            f"{index_file}: shard directory {directory} has no readable .metadata "
            f"(interrupted or corrupted save?): {type(error).__name__}; {RESUME_HINT}"
        ) from error
    damaged = _short_shard_files(directory, metadata)
    if damaged:
        name, size, needed = damaged[0]
        raise ShardedCheckpointError(
            f"{index_file}: shard file {directory / name} is truncated or missing ({size} of "
            f"{needed} bytes); {RESUME_HINT}"
        )
    corrupted = mismatched_shard_files(directory, checksums, collective)
    if corrupted:
        raise ShardedCheckpointError(corruption_message(
            index_file, [str(directory / name) for name in corrupted]))
    entries = metadata.state_dict_metadata
    missing = [p for p in paths if p not in entries]
    if missing:
        raise ShardedCheckpointError(
            f"{index_file}: shard directory {directory} lacks {len(missing)} tensors "
            f"(e.g. {missing[0]}); {RESUME_HINT}"
        )
    return entries


def _short_shard_files(directory: Path, metadata: Any) -> list[tuple[str, int, int]]:
    """Shard files smaller than the metadata says they are: (name, size, needed size)."""
    needed: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        end = item.offset + item.length
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), end)
    short = []
    for name, end in sorted(needed.items()):
        path = directory / name
        size = path.stat().st_size if path.is_file() else 0
        if size < end:
            short.append((name, size, end))
    return short


def saved_shapes(index: dict[str, Any], entries: dict[str, Any], key: str
                 ) -> dict[str, tuple[int, ...]]:
    """Full shapes of the tensors the index holds under ``key`` (e.g. the model's), by
    name; a tied weight's other names refer to where it was saved."""
    shapes = {}
    for name, value in (index.get(key) or {}).items():
        if isinstance(value, dict) and set(value) == {_REF}:
            meta = entries.get(value[_REF])
            if meta is not None and hasattr(meta, "size"):
                shapes[name] = tuple(meta.size)
    return shapes


def load_tensors(
    index_file: str | Path, index: dict[str, Any], targets: dict[str, torch.Tensor],
    no_dist: bool = False,
) -> None:
    """Fill ``targets`` (fresh tensors, DTensors sharded as wanted) from the shards."""
    directory = shard_directory(index_file, index)
    reader = SafeFileSystemReader(directory)
    try:
        dcp.load(targets, storage_reader=reader, no_dist=no_dist)
    except (Exception, CheckpointException) as error:  # the latter is a BaseException
        if reader.refusal is not None:  # DCP reports it only as a string among others
            raise ShardedCheckpointError(f"{index_file}: {reader.refusal}") from error
        cause = _first_failure(error)
        if isinstance(cause, ShardPluginError):  # one line already (a chunk's, say)
            raise ShardedCheckpointError(f"{index_file}: {cause}") from error
        lines = str(cause).strip().splitlines()
        raise ShardedCheckpointError(
            f"{index_file}: could not read the shards in {directory} (a truncated or "
            f"missing shard file?): {type(cause).__name__}: "
            f"{lines[0].strip()[:300] if lines else ''}"
        ) from error


def _first_failure(error: BaseException) -> BaseException:
    """The exception behind a failed ``dcp.load``: that of the lowest rank that failed
    (DCP gathers each rank's into a ``CheckpointException``), else ``error`` itself."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        failed = failures[min(failures)]
        if isinstance(failed, tuple) and failed and isinstance(failed[0], BaseException):
            return failed[0]
    return error


def empty_like_saved(meta: Any, like: torch.Tensor | None = None) -> torch.Tensor:
    """A fresh target for one saved tensor: sharded like ``like`` when shapes agree."""
    dtype = meta.properties.dtype
    if isinstance(like, DTensor) and tuple(like.shape) == tuple(meta.size):
        return torch.empty_like(like, dtype=dtype)
    device = like.device if isinstance(like, torch.Tensor) else "cpu"
    return torch.empty(tuple(meta.size), dtype=dtype, device=device)


def full_tensors(index_file: str | Path, index: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint as a full CPU tensor, in one process."""
    entries = read_shard_metadata(index_file, index)
    targets = {path: empty_like_saved(entries[path]) for path in tensor_paths(index)}
    load_tensors(index_file, index, targets, no_dist=True)
    return targets
