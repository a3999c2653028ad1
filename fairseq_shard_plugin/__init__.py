"""fairseq user dir that makes ``--ddp-backend fully_sharded`` shard per layer and save memory.

Loading it as a user dir (``--user-dir fairseq_shard_plugin``) calls :func:`activate`:
the plugin's tasks, criterion and architectures register with fairseq, checkpoint loading
allows fairseq's config types, and the hooks of :mod:`.fairseq_integration` are installed.
Runs with any other ``--ddp-backend`` behave exactly as stock fairseq.

Importing the package or one of its modules for anything else (the memory model, the
console scripts, a test) installs nothing: the entry points that need the plugin active
(the Hydra callback, ``fairseq-shard-measure-train`` with ``--user-dir``) call
:func:`activate` themselves.

Subpackages, in the direction their imports point (each says what it owns):
``cli`` -> ``training`` -> ``sharding``, ``checkpoint``, ``memory``, ``tasks`` -> fairseq;
:mod:`.fairseq_integration` is the one module that installs hooks into fairseq;
:mod:`.errors` is the base of every error the plugin reports in one line.
"""

from __future__ import annotations

import sys

from fairseq_shard_plugin.errors import exit_with
from fairseq_shard_plugin.torch_support import installed_torch, torch_problem

__version__ = "0.1.0"

# Every use of the package (user dir, console scripts, imports) stops here in one line on a
# torch it cannot run on, instead of failing later inside FSDP2 or a checkpoint write.
_TORCH_PROBLEM = torch_problem(installed_torch())
if _TORCH_PROBLEM:
    exit_with(f"fairseq-shard-plugin: error: {_TORCH_PROBLEM}")  # torchrun's summary too


def activate() -> None:
    """What loading the user dir does: register, allow fairseq's checkpoint config types in
    ``weights_only`` loading, install the hooks, hide fairseq's known-harmless deprecation
    warnings, report the plugin's errors in one line (each step idempotent)."""
    from fairseq_shard_plugin.checkpoint.safe_loading import allow_fairseq_checkpoint_types
    from fairseq_shard_plugin.errors import report_in_one_line
    from fairseq_shard_plugin.fairseq_integration import install
    from fairseq_shard_plugin.tasks import register
    from fairseq_shard_plugin.training.harmless_warnings import hide_harmless_warnings

    register()
    allow_fairseq_checkpoint_types()
    install()
    hide_harmless_warnings()
    report_in_one_line()


def names_this_plugin(user_dir: str) -> bool:
    """Whether a ``--user-dir`` value names this package (any copy of it, by its folder's
    name, as fairseq's ``import_user_module`` imports it)."""
    import os

    return os.path.basename(os.path.normpath(user_dir)) == __name__


def _imported_as_user_dir() -> bool:
    """True when fairseq's ``import_user_module`` is importing this package (``--user-dir``,
    ``common.user_dir``): the only import that should activate the plugin by itself."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_code.co_name == "import_user_module"
                and frame.f_globals.get("__name__") == "fairseq.utils"):
            return True
        frame = frame.f_back
    return False


def activate_or_exit() -> None:
    """:func:`activate`, as the user dir and the Hydra callback do it: a fairseq the plugin
    cannot hook ends the command in one line instead of a traceback through fairseq's
    argument parsing."""
    from fairseq_shard_plugin.errors import ShardPluginError

    try:
        activate()
    except ShardPluginError as error:
        raise SystemExit(f"fairseq-shard-plugin: error: {error}") from None


if _imported_as_user_dir():
    activate_or_exit()
