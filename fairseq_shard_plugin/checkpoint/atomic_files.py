"""Crash-safe checkpoint files: a checkpoint name only ever points at a complete file.

Every write goes to a hidden temporary name in the same directory, is flushed and
fsynced, then renamed over the final name with ``os.replace`` (atomic on POSIX), and the
directory is fsynced so the rename itself survives a power loss. A process killed at any
moment leaves either the previous complete file or the new complete file under the name,
plus at most a leftover ``.NAME.partial-PID@PLACE-RANDOM`` file that :func:`remove_partial_files`
deletes at the next save. The temporary names match none of fairseq's checkpoint patterns,
so neither resume nor ``--keep-interval-updates`` ever picks them.
"""

from __future__ import annotations

import errno
import functools
import glob
import hashlib
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from fairseq_shard_plugin.errors import ShardPluginError, error_behind

_PARTIAL_MARK = ".partial-"
_RANDOM_HEX_DIGITS = 12
_LEFTOVER_NAME = re.compile(  # what _create_partial_file names (the place: since 2026-12-05)
    r"\.(?P<name>.+)" + re.escape(_PARTIAL_MARK)
    + rf"(?P<pid>[0-9]+)(?:@(?P<place>[0-9a-f]{{8}}))?-[0-9a-f]{{{_RANDOM_HEX_DIGITS}}}")
_COPY_CHUNK = 1 << 20


@functools.cache
def _this_place() -> str:
    """Where this process's id means this process: its host and process-id namespace, as 8
    hex digits. A save dir shared by nodes (or containers) holds temporary files whose
    writers' ids mean other processes: those are never judged from here."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return hashlib.sha256(f"{socket.gethostname()}/{namespace}".encode()).hexdigest()[:8]


def _create_partial_file(path: Path) -> tuple[Path, BinaryIO]:
    """A new temporary file beside ``path`` for a write of ``path``, open for writing:
    created exclusively under a fresh unpredictable name (``.NAME.partial-PID@PLACE-RANDOM``), so a
    file or symlink planted under that name is never written through."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        random = secrets.token_hex(_RANDOM_HEX_DIGITS // 2)
        temporary = path.with_name(
            f".{path.name}{_PARTIAL_MARK}{os.getpid()}@{_this_place()}-{random}")
        try:  # (an opener keeps the file object's name the path, as open() gives it)
            return temporary, open(temporary, "wb",  # the caller closes it
                                   opener=lambda name, _: os.open(name, flags, 0o666))
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name beside {path}")


def new_file_refused(path: Path) -> OSError | None:
    """What the system says to the temporary file a write of ``path`` starts with (the same
    name, so the same length), found by creating one and removing it; None where both
    work. ``path`` itself is never opened."""
    try:
        temporary, stream = _create_partial_file(path)
    except OSError as error:
        return error
    stream.close()
    try:
        os.unlink(temporary)
    except OSError as error:
        return error
    return None


def fsync_directory(directory: Path) -> None:
    """Make renames and creations in ``directory`` durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class WriteError(ShardPluginError, OSError):
    """A file that could not be written (a full disk, a quota, permissions); the message
    names it and says that what was under its name is unchanged."""


def os_error_behind(error: BaseException) -> OSError | None:
    """The operating system's error behind ``error``, if any: torch's writers and DCP
    re-raise a failed write as their own errors (DCP keeps each rank's in ``failures``,
    as (exception, stack) pairs)."""
    found = error_behind(error, lambda each: isinstance(each, OSError))
    return found if isinstance(found, OSError) else None


# what torch's C++ zip writer says when the file took fewer bytes than it wrote: the
# operating system's error (ENOSPC, EFBIG) stays inside it
_SHORT_WRITE = ("unexpected pos", "PytorchStreamWriter failed writing")


def describe_write_failure(error: BaseException) -> str | None:
    """The cause of a failed write in words (:func:`describe_os_error`, or torch's writer
    stopping short, which hides the system's error), or None where ``error`` is no write
    failure."""
    cause = os_error_behind(error)
    if cause is not None:
        return describe_os_error(cause)
    short = error_behind(error, lambda each: isinstance(each, RuntimeError)
                         and any(text in str(each) for text in _SHORT_WRITE))
    if short is None:
        return None
    return (f"the file system took fewer bytes than torch wrote (a short write: "
            f"{' '.join(str(short).split())}), as on a full disk or past a file size limit")


def describe_os_error(error: OSError) -> str:
    """``No space left on device (ENOSPC)`` and the like."""
    name = errno.errorcode.get(error.errno or 0)
    return f"{error.strerror or error}" + (f" ({name})" if name else "")


def _process_is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def _leftover_of_ended_write(leftover: Path, name: str | None = None) -> bool:
    """Whether ``leftover`` is a temporary file (or a link under such a name) that a write of
    this module left (``.NAME.partial-PID@PLACE-RANDOM``, of ``name`` where given) and whose
    process has ended: another program's file, a live process's write in progress, or a
    file written on another host or in another process-id namespace (whose ids mean other
    processes here) is not. Names without a place (earlier versions) are judged by id."""
    match = _LEFTOVER_NAME.fullmatch(leftover.name)
    return bool(match and (name is None or match["name"] == name)
                and match["place"] in (None, _this_place())
                and (leftover.is_symlink() or leftover.is_file())
                and _process_is_gone(int(match["pid"])))


def _leftover_of_held_name(leftover: Path, held_names: Callable[[str], bool]) -> bool:
    """A temporary file of a name ``held_names`` accepts, written in another place (this
    place's are judged by their process)."""
    match = _LEFTOVER_NAME.fullmatch(leftover.name)
    return bool(match and match["place"] not in (None, _this_place())
                and held_names(match["name"]) and (leftover.is_symlink() or leftover.is_file()))


def remove_stale_partial_files(path: Path) -> None:
    """Delete the temporary files of earlier writes of ``path`` whose process has ended (a
    killed export or save); a live process's write in progress is left alone."""
    for leftover in path.parent.glob(f".{glob.escape(path.name)}{_PARTIAL_MARK}*"):
        if _leftover_of_ended_write(leftover, path.name):
            leftover.unlink(missing_ok=True)


def write_atomically(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(file)`` on a temporary file, then move it to ``path`` in one step;
    the temporary files that killed writes of ``path`` left are removed first.

    A write the system refuses raises :class:`WriteError` (the temporary file removed)."""
    path = Path(path)
    temporary: Path | None = None
    existed = os.path.lexists(path)
    try:
        remove_stale_partial_files(path)
        temporary, out = _create_partial_file(path)
        with out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        if temporary is not None:
            temporary.unlink(missing_ok=True)
        cause = describe_write_failure(error)
        if cause is None or isinstance(error, WriteError) or not isinstance(error, Exception):
            raise
        raise WriteError(f"could not write {path}: {cause}; "
                         + (f"{path.name} is unchanged" if existed
                            else f"no {path.name} was written")) from error
    fsync_directory(path.parent)


def copy_file_contents(source: Path, out: BinaryIO) -> None:
    """Copy the bytes of ``source`` into the open file ``out``."""
    with open(source, "rb") as src:
        shutil.copyfileobj(src, out, _COPY_CHUNK)


def copy_atomically(source: str | Path, destination: str | Path) -> None:
    """Copy ``source`` to ``destination``; ``destination`` is never seen half-written."""
    write_atomically(destination, lambda out: copy_file_contents(Path(source), out))


def remove_partial_files(
    directory: str | Path, held_names: Callable[[str], bool] = lambda name: False
) -> list[Path]:
    """Delete the temporary files that writes of this module left in ``directory`` when
    their process was killed (and links under such names: removing a link leaves its
    target alone); return them. Other programs' files, and the temporary files of writes
    still in progress (an export beside a training run), are left alone. Leftovers of
    the names ``held_names`` accepts written in another place go too: the caller alone
    writes those names (a training holding its save dir, its checkpoint names), so they
    are a killed save's, from another node or an earlier container."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    leftovers = [p for p in directory.iterdir()
                 if _leftover_of_ended_write(p) or _leftover_of_held_name(p, held_names)]
    for leftover in leftovers:
        leftover.unlink(missing_ok=True)
    return leftovers
