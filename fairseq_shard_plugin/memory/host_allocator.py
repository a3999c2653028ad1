"""Freed host memory back to the system at once on CPU ranks (glibc's mmap threshold)."""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc.h)
# bytes: blocks this large and larger are mapped, and unmapped when freed. 1 MiB returned
# most (the demo: 984 against 1354 MiB of stock's peak RSS per rank, 1086 at 8 MiB) but
# page-faulted every activation afresh: 30% fewer words/s at d 256 (3+3 layers, 2 ranks,
# 2,048 tokens), against 3-5% at 8 MiB, where a unit's gathers and the larger buffers
# still go back (measured by hand, session 26)
MMAP_THRESHOLD = 8 * 1024**2
VARIABLE = "MALLOC_MMAP_THRESHOLD_"  # glibc's own variable for the same setting


def return_freed_blocks(environ: Mapping[str, str] = os.environ) -> str | None:
    """On a CPU rank, the host is the device: have glibc map every block of
    :data:`MMAP_THRESHOLD` and more and unmap it when it is freed. By default glibc raises
    its threshold to the largest block freed so far (up to 32 MiB), after which such blocks
    come from its heap and stay there when freed: a sharded run's all-gather and
    reduce-scatter buffers, freed after each unit, then held peak RSS at stock fairseq's
    (1456 against 1444 MiB per rank in the demo, with 497 against 882 MiB of tensors).
    Nothing where the user set glibc's variable or the C library is not glibc; returns
    what was set, for the log."""
    if VARIABLE in environ or platform.libc_ver()[0] != "glibc":
        return None
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return None
    return f"glibc's mmap threshold at {MMAP_THRESHOLD // 1024**2} MiB ({VARIABLE})"
