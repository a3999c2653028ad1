"""Detect checkpoint files whose bytes changed after they were written.

``torch.load`` reads tensor bytes without checking them, so a flipped bit in a checkpoint
(a bad disk, an interrupted copy that kept the file's length) would load silently.

* Full checkpoints are zip archives (``torch.save``'s format): every entry carries a
  CRC-32, which :func:`damaged_zip_entries` recomputes. This covers stock fairseq's files
  too.
* DCP shard files (``.distcp``) and their ``.metadata`` carry none, so
  :func:`shard_checksums` records a CRC-32 of each in the sharded index at save time and
  :func:`mismatched_shard_files` compares (indexes written before 2026-12-05 have none for
  ``.metadata``).

Both split the files (or entries) among the ranks when called collectively, so each
rank reads only its share; every rank receives the same verdict.
"""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

_CHUNK = 16 << 20
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


def damaged_zip_entries(path: Path, collective: bool = False) -> list[str]:
    """Entries of a ``torch.save`` zip whose CRC-32 does not match their bytes.

    Files that are not zip archives (truncated ones included) return no entries: reading
    them fails later with its own message.
    """
    damaged: list[str] = []
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            names = _my_share([info.filename for info in archive.infolist()], collective)
            for name in names:
                try:
                    with archive.open(name) as entry:
                        while entry.read(_CHUNK):
                            pass
                except (zipfile.BadZipFile, OSError, EOFError):
                    damaged.append(name)
    return _everyones(damaged, collective)


def shard_checksums(directory: Path, collective: bool = True) -> dict[str, int]:
    """CRC-32 of every ``.distcp`` file of a finished DCP save and of its ``.metadata``,
    computed by all ranks."""
    names = sorted(path.name for path in directory.glob("*.distcp"))
    names += [METADATA] if (directory / METADATA).is_file() else []
    mine = {name: file_crc32(directory / name) for name in _my_share(names, collective)}
    return {name: crc for part in _from_every_rank(mine, collective)
            for name, crc in part.items()}


def mismatched_shard_files(
    directory: Path, checksums: dict[str, int], collective: bool = False
) -> list[str]:
    """Shard files whose CRC-32 differs from the recorded one (missing files included)."""
    names = _my_share(sorted(checksums), collective)
    bad = [name for name in names if not (directory / name).is_file()
           or file_crc32(directory / name) != checksums[name]]
    return _everyones(bad, collective)


def corruption_message(checkpoint: str | Path, damaged: list[str]) -> str:
    """One line naming the checkpoint and its first damaged part (zip entry or shard file)."""
    more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
    return (f"{checkpoint}: corrupted checkpoint: {damaged[0]}{more} fails its CRC-32 check "
            f"(its bytes changed after it was saved); {RESUME_HINT}")
