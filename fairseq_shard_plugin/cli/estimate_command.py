"""``fairseq-shard-estimate ... -- <fairseq-train arguments>``: the estimate of a training
command as written.

The arguments after ``--`` are parsed by fairseq's own training parser, the task is set up
(it reads the dictionaries from the data directory, no training data) and the model is
built without memory; the estimator's flags are then read from that configuration and
model exactly as the trainer reads them before its first step
(:func:`fairseq_shard_plugin.memory.run_estimate.run_description`). The estimator's own options
given before ``--`` (``--world-size``, ``--memory-budget``, ``--tokens-per-sentence``,
``--json``, ...) come after them, so they override what the command says. ``--world-size``
is all ranks; with ``--shard-strategy hybrid`` the estimate is for its shard groups
(``--shard-group-size``, required here: no launcher says the ranks per node).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Any

from fairseq_shard_plugin import names_this_plugin
from fairseq_shard_plugin.checkpoint.errors import first_cause
from fairseq_shard_plugin.errors import ShardPluginError
from fairseq_shard_plugin.memory.estimate import (
    LAYER_NORM_SWITCHES,
    SIZE_FLAGS,
    EstimateError,
    build_without_memory,
    parser,
)
from fairseq_shard_plugin.memory.model import ModelShape


def split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(the estimator's flags, the training command's arguments or None without ``--``)."""
    if "--" not in argv:
        return argv, None
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


# the estimator's options that describe the model: with a command, its model is built
MODEL_FLAGS = frozenset(
    "--" + name.replace("_", "-") for name in (
        "arch", "vocab", "attention_dropout", "share_all_embeddings", "no_share_all_embeddings",
        *SIZE_FLAGS, *LAYER_NORM_SWITCHES))


def _option_named(flag: str) -> str:
    """The estimator's option ``flag`` names, as argparse reads it: written out, with
    ``=value``, or abbreviated to a unique prefix (``--voc``); else ``flag`` itself."""
    name = flag.split("=", 1)[0]
    options = [option for action in parser()._actions for option in action.option_strings]
    matches = [option for option in options if option.startswith(name)]
    return name if name in options or len(matches) != 1 else matches[0]


def _refuse_model_flags(estimator_flags: list[str]) -> None:
    """A model option before ``--`` would be printed as used while the command's model is
    estimated: one line naming it."""
    for flag in estimator_flags:
        if flag.startswith("--") and _option_named(flag) in MODEL_FLAGS:
            raise EstimateError(f"{flag.split('=', 1)[0]} before --: the model estimated is "
                                "the one the training command builds; change it in the "
                                "command after --")


def _gives_world_size(estimator_flags: list[str]) -> bool:
    return any(flag.startswith("--") and _option_named(flag) == "--world-size"
               for flag in estimator_flags)


def command_notes(estimator_flags: list[str], train_argv: list[str]) -> list[str]:
    """What the estimate of ``train_argv`` takes that the command does not say: the ranks
    (a command says how many run it only with ``--distributed-world-size``), and sharding
    where it chooses another backend."""
    notes = []
    if not _gives_world_size(estimator_flags) and _stated_world_size(train_argv) is None:
        notes.append(f"Assumed, as the command does not say: --world-size "
                     f"{parser().get_default('world_size')} (give --world-size N before --)")
    backend = _given(train_argv, "--ddp-backend") or "pytorch_ddp"  # fairseq-train's default
    if backend != "fully_sharded":
        notes.append(f"The command does not shard (--ddp-backend {backend}): estimated as with "
                     "--ddp-backend fully_sharded; as written it runs like the unsharded "
                     "column")
    return notes


def _given(train_argv: list[str], flag: str) -> str | None:
    """The value ``flag`` is given in ``train_argv`` (``FLAG VALUE`` or ``FLAG=VALUE``; the
    last one, as argparse takes it), or None."""
    value = None
    for index, word in enumerate(train_argv):
        if word == flag and index + 1 < len(train_argv):
            value = train_argv[index + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def _stated_world_size(train_argv: list[str]) -> int | None:
    """``--distributed-world-size N`` as the training command gives it, if it does."""
    value = _given(train_argv, "--distributed-world-size")
    return int(value) if value is not None and value.isdigit() and int(value) > 0 else None


def _take_world_size(estimator_flags: list[str]) -> tuple[int, list[str]]:
    """``--world-size`` as given before ``--`` (read by the estimator's own parser; a
    training command does not say how many ranks will run it), and the other flags."""
    world_size = parser().parse_known_args(estimator_flags)[0].world_size
    rest, flags = [], iter(estimator_flags)
    for flag in flags:
        if flag == "--world-size":
            next(flags, None)
        elif not flag.startswith("--world-size="):
            rest.append(flag)
    return world_size, rest


def _parse_training_command(train_argv: list[str]) -> Any:
    """fairseq's config for ``fairseq-train train_argv``; its parser's complaint, which
    argparse prints with a usage block and exits on, becomes one line."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_shard_plugin.tasks import register

    register()  # the plugin's tasks, criteria and archs

    complaint = io.StringIO()
    try:
        with contextlib.redirect_stderr(complaint):
            args = options.parse_args_and_arch(options.get_training_parser(),
                                               _without_own_user_dir(train_argv))
    except SystemExit:
        lines = complaint.getvalue().strip().splitlines()
        reason = lines[-1].split("error: ", 1)[-1] if lines else "not a fairseq-train command"
        reason = reason.split(" (choose from ", 1)[0]  # not fairseq's hundreds of archs
        raise EstimateError(f"the training command after --: {reason}") from None
    except RuntimeError as error:  # fairseq's bare RuntimeError() where no --arch is given
        if str(error):
            raise EstimateError(f"the training command after --: {first_cause(error)}") from None
        raise EstimateError("the training command after --: give --arch (the model "
                            "architecture, e.g. transformer or nllb_dense_600m)") from None
    except Exception as error:  # noqa: BLE001 (fairseq's own failure, e.g. --user-dir)
        raise EstimateError(f"the training command after --: {first_cause(error)}") from None
    logging.getLogger("hydra").setLevel(logging.WARNING)
    with warnings.catch_warnings():  # Hydra's deprecation notices of fairseq's compose call
        warnings.simplefilter("ignore")
        try:
            return convert_namespace_to_omegaconf(args)
        except Exception as error:  # noqa: BLE001 (e.g. an arch the task cannot hold)
            raise EstimateError(f"the training command after --: {first_cause(error)}") from None


def _without_own_user_dir(train_argv: list[str]) -> list[str]:
    """``train_argv`` without a ``--user-dir`` naming this plugin: it is imported already
    (its registrations are made), and fairseq refuses a user dir whose package name is
    imported from elsewhere, as after ``pip install .`` with ``--user-dir
    fairseq_shard_plugin`` given from the repository root."""
    kept: list[str] = []
    flags = iter(train_argv)
    for flag in flags:
        if flag == "--user-dir":
            path = next(flags, "")
            if not names_this_plugin(path):
                kept += [flag, path]
        elif not (flag.startswith("--user-dir=") and names_this_plugin(flag.split("=", 1)[1])):
            kept.append(flag)
    return kept


def flags_from_training_command(estimator_flags: list[str], train_argv: list[str]
                                ) -> tuple[list[str], ModelShape]:
    """The estimator's flags for ``fairseq-train train_argv`` followed by
    ``estimator_flags``, and the shape of the model it builds."""
    from fairseq import tasks

    from fairseq_shard_plugin.errors import ShardingConfigError
    from fairseq_shard_plugin.memory.run_estimate import run_description
    from fairseq_shard_plugin.sharding.options import sharding_options
    from fairseq_shard_plugin.sharding.settings import shard_group_size

    _refuse_model_flags(estimator_flags)
    sixteen = set(train_argv)  # fairseq would name a TPU for a mix of fp16 and bf16
    if sixteen & {"--fp16", "--memory-efficient-fp16"} and sixteen & {
            "--bf16", "--memory-efficient-bf16"}:
        raise EstimateError("the training command after --: give fp16 flags "
                            "(--fp16, --memory-efficient-fp16) or bf16 ones, not both")
    cfg = _parse_training_command(train_argv)
    try:
        task = tasks.setup_task(cfg.task)
    except (OSError, ValueError, KeyError) as error:
        cause = (error if isinstance(error, ShardPluginError)  # its line says it all
                 else f"{type(error).__name__}: {error}")
        raise EstimateError(f"the training command after --: its task could not be set up "
                            f"({cause})") from None
    arch = getattr(cfg.model, "arch", None) or getattr(cfg.model, "_name", None)
    model = build_without_memory(lambda: task.build_model(cfg.model), str(arch))
    world_size, others = _take_world_size(estimator_flags)
    stated = _stated_world_size(train_argv)
    if stated is not None and not _gives_world_size(estimator_flags):
        world_size = stated
    try:  # the ranks sharing one copy: all, or one shard group with --shard-strategy hybrid
        sharing = shard_group_size(sharding_options(cfg.task), world_size, environ={})
    except ShardingConfigError as error:
        raise EstimateError(f"the training command after --: {error}") from None
    described = run_description(cfg, model, sharing)
    return [*described.flags, *others], described.shape
