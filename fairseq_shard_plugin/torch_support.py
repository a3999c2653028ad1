"""The torch releases the plugin runs on, checked before anything imports torch.

Older releases fail deep inside (FSDP2 on CPU ranks needs CPU streams with
``record_event``; the checkpoint writer needs ``torch.utils.serialization``), so the package
refuses them in one line instead. The check reads the installed distribution's version, so
it costs no torch import. ``setup.py`` does not require this floor: pip would replace a
user's older torch (and its CUDA build) to meet it, and an existing torch is never replaced.
"""

from __future__ import annotations

import importlib.util
import re
from importlib import metadata

# The oldest release the test suite passed on (2.11: the GPU machine's; 2.13: CI's).
OLDEST_TORCH = (2, 11)


def installed_torch() -> str | None:
    """The installed torch distribution's version (``2.11.0``, ``2.13.0+cpu``); ``unknown``
    for an importable torch without distribution metadata; None when there is no torch."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "unknown" if importlib.util.find_spec("torch") else None


def release(version: str) -> tuple[int, int] | None:
    """``(2, 11)`` of ``2.11.0+cu130``; None where the version does not start with
    major.minor."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def torch_problem(installed: str | None) -> str | None:
    """One line saying what to do when torch ``installed`` is older than
    :data:`OLDEST_TORCH` or absent (None); None when it is recent enough or its version does
    not start with major.minor (a source build: let it run)."""
    oldest = ".".join(map(str, OLDEST_TORCH))
    if installed is None:
        return f"torch is not installed: install torch >= {oldest} first (pip install torch)"
    major_minor = release(installed)
    if major_minor is None or major_minor >= OLDEST_TORCH:
        return None
    return (f"torch {installed} is older than {oldest}, the oldest release the plugin runs "
            f"on (its FSDP2 and checkpoint writer need it): upgrade torch to >= {oldest} "
            "(with its matching CUDA build), or use a stock --ddp-backend without the plugin")
