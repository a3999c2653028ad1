"""A dataclass config for fairseq's multilingual task, so ``fairseq-hydra-train`` can run it.

fairseq's Hydra entry point only sets up tasks registered with a dataclass config, and
``translation_multi_simple_epoch`` (the NLLB recipes' task) declares its options with
argparse. Rather than restating its options (and missing those another fairseq version,
such as the NLLB branch, adds), the dataclass is generated from the parser the task fills
itself: one field per option, holding the option's text as a user writes it on the
command line (``langs: eng_Latn,fra_Latn``, ``decoder_langtok: true``); the options its
parser turns into lists or dictionaries also accept those from YAML. When the task is
set up, :func:`task_namespace` passes those values through that same parser, so types,
choices and ``--lang-pairs`` files are converted exactly as under ``fairseq-train``.
No ``from __future__ import annotations`` here: fairseq reads the field types at runtime.
"""

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Optional

from fairseq.data.indexed_dataset import get_available_dataset_impl
from fairseq.dataclass import ChoiceEnum
from fairseq.tasks.translation_multi_simple_epoch import TranslationMultiSimpleEpochTask
from omegaconf import II, MISSING, OmegaConf

from fairseq_shard_plugin.errors import ShardingConfigError
from fairseq_shard_plugin.sharding.options import ShardingConfig

TASK_NAME = "sharded_translation_multi_simple_epoch"


class MultilingualOptionError(ShardingConfigError):
    """A multilingual task option that its own parser rejects; the message names the key."""


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        flag = re.search(r"argument (--[\w-]+)", message)
        key = f" (Hydra key: task.{flag.group(1)[2:].replace('-', '_')})" if flag else ""
        raise MultilingualOptionError(f"{TASK_NAME}: {message}{key}")


@dataclass
class _GlobalsTheTaskReads(ShardingConfig):
    """Options outside the task's parser that the task reads from its config: under
    ``fairseq-train`` its config is the whole command line, under Hydra only ``task.*``."""

    seed: int = II("common.seed")
    dataset_impl: Optional[ChoiceEnum(get_available_dataset_impl())] = II(  # type: ignore[valid-type]  # noqa: UP045
        "dataset.dataset_impl"
    )
    train_subset: str = II("dataset.train_subset")
    valid_subset: str = II("dataset.valid_subset")  # the nllb branch's data manager reads it


# The nllb branch's data-source tags, in the order it adds them to the dictionary (after
# the language tokens): ``DATA_SOURCE_PREFIX_TAGS`` and ``augment_dictionary`` in its
# fairseq/data/multilingual/multilingual_utils.py. Released NLLB-200 models carry them.
DATA_SOURCE_PREFIX_TAGS = {"mining": "<MINED_DATA>", "mmt_bt": "<MMT_BT_DATA>",
                           "smt_bt": "<SMT_BT_DATA>"}
PREFIX_TAGS_FLAG = "--add-data-source-prefix-tags"


@cache
def fairseq_adds_prefix_tags() -> bool:
    """True where fairseq's own task has ``--add-data-source-prefix-tags`` (the nllb
    branch), so fairseq adds the tags itself; fairseq 0.12 has no such option."""
    parser = argparse.ArgumentParser(add_help=False)
    TranslationMultiSimpleEpochTask.add_args(parser)
    return any(PREFIX_TAGS_FLAG in a.option_strings for a in parser._actions)


@cache
def task_parser() -> argparse.ArgumentParser:
    """The parser ``translation_multi_simple_epoch`` fills, raising on bad values; plus the
    nllb branch's ``--add-data-source-prefix-tags`` where fairseq lacks it (the plugin's
    task then adds the tags, see :mod:`.sharded_multilingual`)."""
    parser = _RaisingParser(prog=TASK_NAME, add_help=False)
    TranslationMultiSimpleEpochTask.add_args(parser)
    if not fairseq_adds_prefix_tags():
        parser.add_argument(
            PREFIX_TAGS_FLAG, default=False, action="store_true",
            help="add the nllb branch's data-source tags (" + ", ".join(
                DATA_SOURCE_PREFIX_TAGS.values()) + ") to the dictionary after the language "
            "tokens, as released NLLB-200 models have them (on fairseq 0.12 the vocabulary "
            "only: sentences of train_mining etc. are not prefixed)")
    return parser


def task_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.dest not in ("help", argparse.SUPPRESS)]


_PLAIN_STORE = type(argparse.ArgumentParser().add_argument("--x"))  # argparse's "store"


def _converts_text(action: argparse.Action) -> bool:
    """True for options whose parser turns the text into something else (a list, a dict,
    a file's contents): a converting ``type=`` or an action class of the task's own."""
    return action.type not in (None, str, int, float) or type(action) is not _PLAIN_STORE


def _is_flag(action: argparse.Action) -> bool:
    return action.nargs == 0


def _field(action: argparse.Action) -> tuple[str, Any, Any]:
    help_text = {"help": action.help or ""}
    if _is_flag(action):
        return action.dest, bool, field(default=bool(action.default), metadata=help_text)
    if not action.option_strings:  # the positional data path
        return action.dest, str, field(default=MISSING, metadata=help_text)
    default = action.default
    if (_converts_text(action) or action.nargs not in (None, "?")
            or not isinstance(default, (str, int, float, type(None)))):
        # text to convert, or the converted value itself from a YAML list or mapping
        return action.dest, Any, field(default_factory=lambda: default, metadata=help_text)
    kind = action.type if action.type in (int, float) else str
    return action.dest, Optional[kind], field(default=default, metadata=help_text)  # noqa: UP045


def _build_config() -> type:
    own = {f.name for f in dataclasses.fields(_GlobalsTheTaskReads)}
    fields = [_field(a) for a in task_options(task_parser()) if a.dest not in own]
    return dataclasses.make_dataclass(
        "ShardedMultilingualConfig", fields, bases=(_GlobalsTheTaskReads,),
        namespace={"__doc__": "``translation_multi_simple_epoch``'s options as text, plus "
                   "the sharding options."},
    )


ShardedMultilingualConfig = _build_config()


def add_text_options(parser: argparse.ArgumentParser) -> None:
    """Under ``fairseq-train``: the task's options, each keeping the text typed, as Hydra
    holds them (fairseq copies the parsed values into the dataclass config, where a list
    or a dictionary would not fit); :func:`task_namespace` converts them, for both entry
    points. An option the model already defines (``--max-source-positions``) is skipped,
    as the task itself does."""
    for action in task_options(task_parser()):
        if not action.option_strings:
            parser.add_argument(action.dest, help=action.help)
            continue
        if _is_flag(action):
            kwargs = {"action": "store_const", "const": action.const}
        else:
            kwargs = {"nargs": action.nargs, "metavar": action.metavar,
                      "type": None if _converts_text(action) else action.type,
                      "choices": None if _converts_text(action) else action.choices}
        try:
            parser.add_argument(*action.option_strings, dest=action.dest,
                                default=action.default, help=action.help, **kwargs)
        except argparse.ArgumentError:
            continue


def _values(cfg: Any) -> dict[str, Any]:
    if OmegaConf.is_config(cfg):
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise MultilingualOptionError(
                f"{TASK_NAME}: set {', '.join(f'task.{key}' for key in missing)} "
                "(the config leaves it ???)")
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    if dataclasses.is_dataclass(cfg):
        return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return dict(vars(cfg))


def task_namespace(cfg: Any) -> argparse.Namespace:
    """The ``argparse.Namespace`` that ``translation_multi_simple_epoch`` expects, from this
    task's config (Hydra's, or the one fairseq built from the command line)."""
    values = _values(cfg)
    argv: list[str] = []
    already_converted: dict[str, Any] = {}
    for action in task_options(task_parser()):
        value = values.get(action.dest)
        if not action.option_strings:
            argv.insert(0, str(value))
        elif _is_flag(action):
            if value == action.const:
                argv.append(action.option_strings[-1])
        elif value is None:
            continue
        elif isinstance(value, (list, tuple)) and action.nargs not in (None, "?"):
            argv += [action.option_strings[-1], *map(str, value)]
        elif isinstance(value, (str, int, float)):
            argv.append(f"{action.option_strings[-1]}={value}")
        else:
            already_converted[action.dest] = value
    try:
        parsed = vars(task_parser().parse_args(argv))
    except (NameError, SyntaxError) as error:  # a converting type= that evals the text
        raise MultilingualOptionError(_culprit(values, error)) from None
    namespace = argparse.Namespace(**{**values, **parsed, **already_converted})
    _check_values_fairseq_reads_later(namespace)
    return namespace


def _culprit(values: dict[str, Any], error: Exception) -> str:
    """The option whose converter raised ``error`` (argparse passes only its own errors on):
    each converting option's text is converted again, alone."""
    for action in task_options(task_parser()):
        text = values.get(action.dest)
        if isinstance(text, str) and callable(action.type) and action.type not in (str, int,
                                                                                    float):
            try:
                action.type(text)
            except Exception as own:
                return (f"{TASK_NAME}: argument {action.option_strings[-1]} (Hydra key: "
                        f"task.{action.dest}): {text!r} is not a value of it "
                        f"({type(own).__name__}: {str(own).splitlines()[0][:120]})")
    return f"{TASK_NAME}: an option's value could not be read: {type(error).__name__}: {error}"


def _check_values_fairseq_reads_later(namespace: argparse.Namespace) -> None:
    """Values the parser accepts that fairseq's data manager fails on once the data loads:
    booleans it evals from text, and sizes it divides by."""
    for dest in ("left_pad_source", "left_pad_target"):
        value = getattr(namespace, dest, None)
        if isinstance(value, str) and value not in ("True", "False"):
            flag = "--" + dest.replace("_", "-")
            raise MultilingualOptionError(
                f"{TASK_NAME}: argument {flag} (Hydra key: task.{dest}): {value!r}: give "
                "True or False")
    for dest in ("virtual_epoch_size", "virtual_data_size"):
        value = getattr(namespace, dest, None)
        if value is not None and value <= 0:
            flag = "--" + dest.replace("_", "-")
            raise MultilingualOptionError(
                f"{TASK_NAME}: argument {flag} (Hydra key: task.{dest}): {value}: give a "
                "positive number of examples, or leave it out")
