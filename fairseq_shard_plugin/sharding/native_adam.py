"""The host Adam step in C for CPU shards (``native_adam.c``).

torch has no fused Adam for a 16-bit parameter with scaled fp16 moments, so the pure-torch
step makes fp32 copies and about ten passes over them. The C step reads each element once
per pass and writes it back, over all of a group's tensors in one call, on torch's
intra-op thread count (which the plugin splits among a host's ranks). fp32 state takes it
too: as fast as torch's fused kernel, its arithmetic bit for bit, and it releases the GIL
for the whole call, so it can run beside the next forward (``host_step_overlap``).

The library is compiled on first use with the system's C compiler (``$CC``, else ``cc``:
about a second) into ``$XDG_CACHE_HOME/fairseq_shard_plugin`` (``~/.cache`` by default),
named by a hash of the source, the flags, the compiler and this CPU's features, so that a
home directory shared by different machines never loads code built for another CPU.
Without a compiler, the step stays in torch (for 16-bit state several times slower, and in
line); the log says so once. ``FAIRSEQ_SHARD_PLUGIN_NATIVE_ADAM=0`` turns the C step off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import torch

from fairseq_shard_plugin.sharding.settings import launcher_rank

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_adam.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-strict-aliasing",
         "-fPIC", "-shared", "-pthread")
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
SWITCH = "FAIRSEQ_SHARD_PLUGIN_NATIVE_ADAM"


class AdamTensor(ctypes.Structure):
    """One tensor's pointers and per-tensor constants (``AdamTensor`` in the C source)."""

    _fields_ = [("param", ctypes.c_void_p), ("grad", ctypes.c_void_p),
                ("exp_avg", ctypes.c_void_p), ("exp_avg_sq", ctypes.c_void_p),
                ("numel", ctypes.c_int64), ("param_dtype", ctypes.c_int32),
                ("grad_dtype", ctypes.c_int32), ("moment_dtype", ctypes.c_int32),
                ("scale_in", ctypes.c_float * 2), ("scale_out", ctypes.c_float * 2),
                ("step_size", ctypes.c_float), ("bias_correction2_sqrt", ctypes.c_float),
                ("eps", ctypes.c_float)]


class AdamGroup(ctypes.Structure):
    """A parameter group's constants (``AdamGroup`` in the C source)."""

    _fields_ = [("beta2", ctypes.c_float), ("avg_sq_grad_coefficient", ctypes.c_float),
                ("lerp_weight", ctypes.c_float), ("keep", ctypes.c_float),
                ("grad_divisor", ctypes.c_float)]


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The compiled step, built on first use; None where it cannot be (said once)."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    given = os.environ.get("CC") or "cc"
    try:  # a command with its own arguments, as make takes it (CC="ccache gcc")
        words = shlex.split(given)
    except ValueError:
        words = []
    found = shutil.which(words[0]) if words else None
    if found is None:
        _warn_on_node(f"no C compiler ({'CC=' + given if 'CC' in os.environ else 'cc'}) on "
                       "PATH: the host Adam step runs in torch, in line (16-bit state several "
                       "times slower); install gcc (or set CC) to build the fast one")
        return None
    compiler = [found, *words[1:]]
    try:
        path = _built_library(compiler)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or error
        first_line = str(detail).strip().splitlines()[0] if str(detail).strip() else error
        _warn_on_node(f"could not build the C host Adam step ({first_line}): it runs in "
                       "torch, in line (16-bit state several times slower)")
        return None
    for name in ("adam_moment_maxima", "adam_update"):
        getattr(library, name).restype = ctypes.c_int
    return library


def _warn_on_node(message: str) -> None:
    """Log ``message`` from the first rank of each node only: the compiler and the cache
    folder are the node's, so its other ranks meet the same."""
    if launcher_rank(names=("LOCAL_RANK", "SLURM_LOCALID")) in (None, 0):
        logger.warning(message)


def _built_library(compiler: list[str]) -> Path:
    """The cached library for this source, compiler (a command) and CPU, compiled if
    missing."""
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True,
                             check=True).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(),
                 _cpu_features().encode(), shlex.join(compiler).encode()):  # (CC's own flags)
        key.update(part)
    directory = _cache_directory()
    path = directory / f"native_adam-{key.hexdigest()[:20]}.so"
    if path.is_file() and not path.is_symlink():
        return path
    handle, partial = tempfile.mkstemp(dir=directory, prefix=".native_adam-", suffix=".so")
    os.close(handle)
    try:
        subprocess.run([*compiler, *FLAGS, "-o", partial, str(SOURCE)], capture_output=True,
                       text=True, check=True)
        os.replace(partial, path)  # ranks building at once each replace a whole file
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path


def _cache_directory() -> Path:
    """The plugin's own cache folder: created private, and refused when someone else's."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    directory = base / "fairseq_shard_plugin"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.lstat()
    if stat.S_ISLNK(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise OSError(f"{directory} is not a private folder of this user")
    return directory


def _cpu_features() -> str:
    """This CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor() + platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))
