"""Detect checkpoint files whose bytes changed after they were written.

``torch.load`` reads tensor bytes without checking them, so a flipped bit in a checkpoint
(a bad disk, an interrupted copy that kept the file's length) would load silently.

* Full checkpoints are zip archives (``torch.save``'s format): every entry carries a
  CRC-32, which :func:`damaged_zip_entries` recomputes (an entry that cannot be read back
  at all, encrypted say, is damaged too). This covers stock fairseq's files too.
* DCP shard files (``.distcp``) and their ``.metadata`` carry none, so
  :func:`shard_checksums` records a CRC-32 of each in the sharded index at save time and
  :func:`mismatched_shard_files` compares (indexes written before 2026-12-05 have none for
  ``.metadata``); it opens no name that is not a regular file of the shard directory.

Both split the files (or entries) among the ranks when called collectively, so each
rank reads only its share; every rank receives the same verdict.
"""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fairseq_shard_plugin.checkpoint.shard_metadata import resolves_outside
from fairseq_shard_plugin.errors import ShardPluginError

_CHUNK = 16 << 20
_ENCRYPTED = 0x1  # a zip entry's general purpose flag bit
METADATA = ".metadata"  # DCP's file of tensor names, shapes and chunk offsets
# What every refusal of a damaged checkpoint ends with.
RESUME_HINT = ("resume from an intact checkpoint with --restore-file (fairseq-shard-verify "
               "SAVE_DIR lists them)")


def file_crc32(path: Path) -> int:
    """CRC-32 of a whole file, read in chunks."""
    crc = 0
    with open(path, "rb") as stream:
        while chunk := stream.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _my_share(items: list[str], collective: bool) -> list[str]:
    if collective and dist.is_initialized():
        return items[dist.get_rank()::dist.get_world_size()]
    return items


def _from_every_rank(value: Any, collective: bool) -> list[Any]:
    """``value`` from every rank (a collective when ``collective``), else just this one."""
    if not (collective and dist.is_initialized()):
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _everyones(found: list[str], collective: bool) -> list[str]:
    """The union of every rank's findings, sorted."""
    return sorted(name for part in _from_every_rank(found, collective) for name in part)


class UnreadableEntry(str):
    """The name of a zip entry that cannot even be read back; ``reason`` says why."""

    reason: str

    def __new__(cls, name: str, reason: str) -> UnreadableEntry:
        entry = super().__new__(cls, name)
        entry.reason = reason
        return entry

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # gathered from every rank
        return UnreadableEntry, (str(self), self.reason)


def _entry_problem(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> str | None:
    """The name of ``info`` if its bytes do not read back intact (an :class:`UnreadableEntry`
    where they cannot be read at all), else None."""
    if info.flag_bits & _ENCRYPTED:
        return UnreadableEntry(info.filename, "it is encrypted")
    try:
        with archive.open(info) as entry:
            while entry.read(_CHUNK):
                pass
    except (zipfile.BadZipFile, OSError, EOFError):
        return info.filename
    except Exception as error:  # anything else this data makes zipfile raise
        detail = (str(error).splitlines() or [""])[0][:200]
        return UnreadableEntry(info.filename, f"compression method {info.compress_type}, "
                               f"flags {info.flag_bits:#x}: {type(error).__name__}: {detail}")
    return None


def is_truncated_zip(path: Path) -> bool:
    """Whether ``path`` begins as a zip file (torch.save's format) but has no zip directory,
    which is written last: the end of the file is missing."""
    with open(path, "rb") as stream:
        return stream.read(4) == b"PK\x03\x04" and not zipfile.is_zipfile(path)


def damaged_zip_entries(path: Path, collective: bool = False) -> list[str]:
    """Entries of a ``torch.save`` zip whose CRC-32 does not match their bytes, or that
    cannot be read back at all (encrypted, an unknown compression method: torch.save
    writes neither).

    Files that are not zip archives (truncated ones included) return no entries: reading
    them fails later with its own message.
    """
    damaged: list[str] = []
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
            mine = set(_my_share([info.filename for info in infos], collective))
            problems = (_entry_problem(archive, info) for info in infos if info.filename in mine)
            damaged = [problem for problem in problems if problem is not None]
    return _everyones(damaged, collective)


def shard_checksums(directory: Path, collective: bool = True) -> dict[str, int]:
    """CRC-32 of every ``.distcp`` file of a finished DCP save and of its ``.metadata``,
    computed by all ranks."""
    names = sorted(path.name for path in directory.glob("*.distcp"))
    names += [METADATA] if (directory / METADATA).is_file() else []
    mine = {name: file_crc32(directory / name) for name in _my_share(names, collective)}
    return {name: crc for part in _from_every_rank(mine, collective)
            for name, crc in part.items()}


class UnsafeShardFileError(ShardPluginError, RuntimeError):
    """A name in a sharded index's checksums that is not a regular file of its shard
    directory (or no file name at all): refused without opening it."""


def _why_not_to_open(directory: Path, name: Any) -> str | None:
    """Why the file the index names ``name`` must not be opened; None where it is a regular
    file of ``directory`` or absent (absent ones are reported as mismatched)."""
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        return f"{str(name)[:200]!r}, which is not a file name of {directory}"
    path = directory / name
    try:
        if resolves_outside(directory, name):
            return (f"{path}, which resolves to {path.resolve()}, outside its directory "
                    "(a symlink?)")
        if path.exists() and not path.is_file():
            return f"{path}, which is not a regular file (a FIFO, a device, a directory?)"
    except (OSError, RuntimeError) as error:  # a symlink loop, a name too long
        return f"{path}, which cannot be resolved ({type(error).__name__})"
    return None


def mismatched_shard_files(
    directory: Path, checksums: dict[str, int], collective: bool = False
) -> list[str]:
    """Shard files whose CRC-32 differs from the recorded one (missing files included).

    Every rank first checks every name without opening it: one that is no regular file of
    ``directory`` raises :class:`UnsafeShardFileError` on all ranks alike.
    """
    for name in checksums:
        problem = _why_not_to_open(directory, name)
        if problem:
            raise UnsafeShardFileError(f"the sharded checkpoint's checksums name {problem}: "
                                       f"refused unread; {RESUME_HINT}")
    names = _my_share(sorted(checksums), collective)
    bad = [name for name in names if not (directory / name).is_file()
           or file_crc32(directory / name) != checksums[name]]
    return _everyones(bad, collective)


def corruption_message(checkpoint: str | Path, damaged: list[str],
                       advice: str = RESUME_HINT) -> str:
    """One line naming the checkpoint and its first damaged part (zip entry or shard file),
    ending with ``advice``."""
    first = damaged[0]
    more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
    problem = "fails its CRC-32 check (its bytes changed after it was saved)"
    if isinstance(first, UnreadableEntry):
        problem = (f"cannot be read back ({first.reason}; torch.save writes no such entry: "
                   "the file was changed after it was saved)")
    return f"{checkpoint}: corrupted checkpoint: {first}{more} {problem}; {advice}"
