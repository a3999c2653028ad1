"""One training per save dir, and one save dir for every rank of a training.

Two trainings saving into one directory overwrite each other's checkpoints, and in the
sharded format one run's cleanup deletes the shards of the other's newest save, whose index
is not written yet. Ranks that resolve ``--save-dir`` to different directories (a relative
save dir under Hydra's per-rank ``${now:...}`` run directories with ``hydra.job.chdir``, or a
node-local disk) split every sharded save between them and resume from different files.

So, before training, rank 0 takes an exclusive ``flock`` on
``SAVE_DIR/.fairseq-shard-plugin.lock`` (held until the training ends, when the file is
removed; the kernel drops the lock of a process that dies) and writes a probe file there
that every rank must see at the same absolute path. (Holding the save dir, the trainer
removes before its first update the shard directories no checkpoint refers to, which a
killed or failed save leaves, before the first save needs their space.)
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import logging
import os
import secrets
import socket
import stat
from collections.abc import Iterator

import torch.distributed as dist

from fairseq_shard_plugin.checkpoint.atomic_files import describe_os_error
from fairseq_shard_plugin.errors import ShardingConfigError

logger = logging.getLogger(__name__)

LOCK_NAME = ".fairseq-shard-plugin.lock"
_PROBE_PREFIX = ".fairseq-shard-plugin-probe-"


class SaveDirInUseError(ShardingConfigError):
    """Another training holds the save dir, or the ranks do not share one."""


@contextlib.contextmanager
def claimed_save_dir(save_dir: str) -> Iterator[None]:
    """Collective: hold ``save_dir`` for the training inside the block (see the module
    docstring); every rank raises the same :class:`SaveDirInUseError` where it cannot."""
    path = os.path.abspath(save_dir)
    lock = None
    try:
        verdict = probe = ""
        if not _rank():
            verdict, lock = _lock(path)
            verdict, probe = (verdict, "") if verdict else _write_probe(path)
        agreed = _from_rank_0([path, verdict, probe])
        problem = agreed[1] or _probe_problem(path, agreed[0], agreed[2])
        try:
            _raise_first(problem)  # once every rank has looked for the probe
        finally:
            if probe:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(path, probe))
        yield
    finally:
        if lock is not None:
            _release(path, lock)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _lock(path: str) -> tuple[str, int | None]:
    """Rank 0: (why the save dir cannot be held, or "") and the held lock's descriptor."""
    lock_file = os.path.join(path, LOCK_NAME)
    for _ in range(10):  # again where the file was removed between open and lock
        try:
            os.makedirs(path, exist_ok=True)
            descriptor = os.open(lock_file,
                                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as error:
            if _no_regular_file(lock_file):
                return _not_a_lock_file(lock_file), None
            if os.path.exists(path) and not os.path.isdir(path):
                return (f"the save dir {path} is a file, not a directory: give a --save-dir "
                        "(checkpoint.save_dir) that is a directory or does not exist yet"), None
            return (f"cannot write to the save dir {path}: {describe_os_error(error)}; give a "
                    "--save-dir (checkpoint.save_dir) that can be written, or --no-save"), None
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # a FIFO, a device
            os.close(descriptor)
            return _not_a_lock_file(lock_file), None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(descriptor, 200, 0).decode(errors="replace").strip()
            except OSError:
                holder = ""
            os.close(descriptor)
            return (f"another training ({holder or 'its process unknown'}) is saving its "
                    f"checkpoints into {path}: give this one its own --save-dir "
                    "(checkpoint.save_dir), or wait until that one has ended"), None
        except OSError as error:  # a file system without locks (ENOLCK, EOPNOTSUPP)
            os.close(descriptor)
            logger.warning(f"{path} cannot be locked ({describe_os_error(error)}): nothing "
                           "stops another training from saving into it at the same time")
            return "", None
        if _same_file(descriptor, lock_file):
            break
        os.close(descriptor)  # locked a file its last holder had just removed
    else:
        return f"could not lock {lock_file}: it keeps being replaced", None
    _held[0] = descriptor
    _remove_stale_probes(path)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    with contextlib.suppress(OSError):  # who holds it, for a second run's message only
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"pid {os.getpid()} on {socket.gethostname()}, since "
                  f"{started}\n".encode(), 0)
    return "", descriptor


def _no_regular_file(lock_file: str) -> bool:
    """Whether something other than a regular file is there under the lock file's name."""
    try:
        return not stat.S_ISREG(os.lstat(lock_file).st_mode)
    except OSError:
        return False


def _not_a_lock_file(lock_file: str) -> str:
    kind = ("a symbolic link" if os.path.islink(lock_file) else "a directory"
            if os.path.isdir(lock_file) else "not a regular file")
    return (f"{lock_file} is {kind}, not the plugin's lock file (which it writes and removes, "
            "and never follows): remove it")


def _same_file(descriptor: int, path: str) -> bool:
    try:
        held, named = os.fstat(descriptor), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def _release(path: str, descriptor: int) -> None:
    """Remove the lock file while it is still held (a run that opened it meanwhile finds
    it replaced, see :func:`_lock`), then let it go."""
    _held[0] = None
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(path, LOCK_NAME))
    os.close(descriptor)


# The held lock's descriptor. A process forked while it is held (fairseq's data loader
# workers) closes its copy: the lock belongs to the open file, so a worker that outlives a
# killed rank 0 would otherwise keep the save dir locked; closing a copy keeps it held.
_held: list[int | None] = [None]


def _close_in_child() -> None:
    if _held[0] is not None:
        with contextlib.suppress(OSError):
            os.close(_held[0])
        _held[0] = None


os.register_at_fork(after_in_child=_close_in_child)


def _remove_stale_probes(path: str) -> None:
    """Probe files of claims whose process was killed before removing its own."""
    with contextlib.suppress(OSError):
        for name in os.listdir(path):
            if name.startswith(_PROBE_PREFIX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(path, name))


def _write_probe(path: str) -> tuple[str, str]:
    """Rank 0: (why no probe could be written, or "") and the probe file's name."""
    name = _PROBE_PREFIX + secrets.token_hex(8)
    try:
        with open(os.path.join(path, name), "x"):
            pass
    except OSError as error:
        return (f"cannot write to the save dir {path}: {describe_os_error(error)}; give a "
                "--save-dir (checkpoint.save_dir) that can be written, or --no-save"), ""
    return "", name


def _from_rank_0(values: list[str]) -> list[str]:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(values, src=0)
    return values


def _probe_problem(mine: str, rank_0s: str, probe: str) -> str:
    """Why this rank does not share rank 0's save dir ("" where it does)."""
    if not _rank() or os.path.exists(os.path.join(mine, probe)):
        return ""
    if mine != rank_0s:
        return (f"the save dir is {rank_0s} on rank 0 but {mine} on rank {_rank()}: every rank "
                "must save into one directory (a relative --save-dir resolves from each "
                "rank's working directory, which Hydra makes per rank with hydra.job.chdir "
                "and a ${now:...} hydra.run.dir): give an absolute --save-dir "
                "(checkpoint.save_dir)")
    return (f"rank {_rank()} does not see rank 0's files in the save dir {mine} (a disk of "
            "its own node?): every rank reads the checkpoints there, so --save-dir must be "
            "on a file system all nodes share")


def _raise_first(problem: str) -> None:
    """Collective: raise the first rank's problem on every rank, if any rank has one."""
    problems = [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems = [""] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    first = next((text for text in problems if text), "")
    if first:
        raise SaveDirInUseError(first)
