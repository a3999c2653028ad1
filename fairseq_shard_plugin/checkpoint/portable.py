"""An exported checkpoint that stock fairseq reads on its own, without the plugin.

Since torch 2.6 ``torch.load`` reads with ``weights_only=True``, which refuses the
``argparse.Namespace`` fairseq keeps as the model's config and the numpy arrays of its saved
metrics: stock ``fairseq-generate`` cannot read fairseq's own checkpoints. A checkpoint
written by the plugin also names the plugin's task, criterion and architectures, which a
process without ``--user-dir`` does not know. :func:`portable_state` turns the config of an
inference export into plain containers and stock names, so that any fairseq, and
``torch.load(weights_only=True)`` alone, reads it:

- every ``argparse.Namespace`` becomes a dict of its values (fairseq builds the model from
  either), numpy values become Python numbers and lists;
- ``sharded_translation`` becomes ``translation``, the sharded multilingual task
  ``translation_multi_simple_epoch``, the chunked criterion ``label_smoothed_cross_entropy``,
  the NLLB architecture names ``transformer`` (the config holds every value they set), and
  the plugin's own options and ``common.user_dir`` are dropped; a task registered without
  a dataclass (the multilingual one) is also named under ``task``, where fairseq's
  ``setup_task`` looks for such tasks (``from_pretrained`` builds the task from it);
- the saved metrics (training meters, with numpy arrays under ``--eval-bleu``) are dropped:
  inference needs none of them;
- ``langs`` is the list of codes, not the ``--langs`` file's path
  (:func:`languages_as_lists`, which every save and load of the plugin applies too).

Tensors are left as they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from fairseq.utils import split_paths
from omegaconf import DictConfig, open_dict
from omegaconf.errors import MissingMandatoryValue

from fairseq_shard_plugin.sharding.options import ShardingConfig

logger = logging.getLogger(__name__)

# the plugin's tasks (tasks.sharded_translation, tasks.multilingual_config.TASK_NAME)
STOCK_TASKS = {"sharded_translation": "translation",
               "sharded_translation_multi_simple_epoch": "translation_multi_simple_epoch"}
STOCK_CRITERIA = {"chunked_label_smoothed_cross_entropy": "label_smoothed_cross_entropy"}
# stock tasks registered without a dataclass: fairseq's setup_task finds them from a config
# only by its "task" key (``from_pretrained`` builds the task from the checkpoint's config)
ARGPARSE_TASKS = frozenset({"translation_multi_simple_epoch"})
# architectures the plugin registers (tasks.nllb_architectures): transformers by stock name
PLUGIN_ARCHITECTURES = ("nllb_dense_600m", "nllb_dense_1_3b", "nllb_dense_3_3b",
                        "transformer_12_12", "transformer_24_24", "transformer_24_24_big")
# a checkpoint's top-level key (fairseq reads only the keys it knows): its cfg.model was a
# Namespace, written as a dict (with_plain_config)
MODEL_WAS_NAMESPACE = "fairseq_shard_plugin_model_cfg_was_namespace"
# the plugin's options (task or model config) and the chunked criterion's own
PLUGIN_KEYS = frozenset({f.name for f in dataclasses.fields(ShardingConfig)
                         if not f.name.startswith("_")} | {"loss_chunk_tokens"})


def plain(value: Any) -> Any:
    """``value`` with Namespaces as dicts and numpy values as Python ones, recursively.

    A container held in several places is converted once, and its conversion is shared
    as the original was (lists sharing each other would otherwise cost a walk per path)."""
    converted: dict[int, Any] = {}

    def convert(item: Any) -> Any:
        if isinstance(item, (np.ndarray, np.generic)):
            return item.tolist()
        if not isinstance(item, (argparse.Namespace, dict, list, tuple)):
            return item
        if id(item) not in converted:
            entries = vars(item) if isinstance(item, argparse.Namespace) else item
            if isinstance(entries, dict):
                converted[id(item)] = {key: convert(entry) for key, entry in entries.items()}
            else:
                converted[id(item)] = type(entries)(convert(entry) for entry in entries)
        return converted[id(item)]

    return convert(value)


def _stock_names(section: dict[str, Any] | None, names: dict[str, str],
                 *keys: str) -> dict[str, Any] | None:
    if not isinstance(section, dict):
        return section
    section = {k: v for k, v in section.items() if k not in PLUGIN_KEYS}
    for key in keys:
        if section.get(key) in names:
            section[key] = names[section[key]]
    return section


def config_entry(config: Any, key: str) -> Any:
    """``config[key]`` of a mapping or an omegaconf config, ``config.key`` of a namespace,
    else None (a saved checkpoint's config may be any of them)."""
    if config is None:
        return None
    if hasattr(config, "get"):
        return config.get(key)
    return getattr(config, key, None)


def saved_without_optimizer_state(state: dict[str, Any]) -> bool:
    """Whether ``state`` is a training checkpoint whose run chose not to save optimizer
    state (its config has ``--no-save-optimizer-state``; it still records the update count
    and the learning-rate scheduler's state), as opposed to an export of a run that did."""
    if "last_optimizer_state" in state:
        return False
    history = state.get("optimizer_history")
    chose = (config_entry(config_entry(state.get("cfg"), "checkpoint"), "no_save_optimizer_state")
             or config_entry(state.get("args"), "no_save_optimizer_state"))
    return bool(chose) and isinstance(history, list) and bool(history) and isinstance(
        history[-1], dict) and "num_updates" in history[-1]


def _config_section(state: Any, key: str) -> Any:
    """``cfg.<key>`` of a saved state (dicts) or a loaded one (omegaconf), or None."""
    return config_entry(state.get("cfg") if isinstance(state, dict) else None, key)


# what a language code may hold (eng_Latn, ar_AR, __en__, zh-Hans, en-US.x): word
# characters, hyphens, dots and @; and the largest langs file read (NLLB's 202 codes: 2 KB)
_LANGUAGE_CODE = re.compile(r"[\w.@-]{1,64}")
_LANGS_FILE_LIMIT = 1 << 20




def languages_numbering_the_tokens(state: Any) -> list[str] | None:
    """The language list that numbered a multilingual checkpoint's language tokens, where
    the checkpoint itself says: its stored list, or (trained with neither --langs nor
    --lang-dict) the sorted languages of its --lang-pairs, as fairseq infers them. None
    where it holds only a file's path: that file may be another now (a relative path read
    from another directory, an edited file), so it is never the ground for a refusal."""
    task = _config_section(state, "task")
    langs = config_entry(task, "langs")
    if isinstance(langs, str) and "," in langs:  # the codes themselves, not a file's path
        return [code.strip() for code in langs.split(",") if code.strip()]
    if langs is not None and not isinstance(langs, str):
        try:
            return [str(code) for code in langs]
        except TypeError:
            return None
    pairs = config_entry(task, "lang_pairs")
    if langs is not None or config_entry(task, "lang_dict") is not None or not pairs:
        return None
    if isinstance(pairs, str):
        pairs = pairs.split(",")
    try:
        return sorted({code for pair in pairs for code in str(pair).strip().split("-")})
    except TypeError:
        return None


def stored_language_tokens(state: Any) -> tuple[Any, bool] | None:
    """The checkpoint's ``--encoder-langtok`` and ``--decoder-langtok`` (``cfg.task``), or
    None where its task config has neither (another task)."""
    section = _config_section(state, "task")
    if section is None or not any(config_has(section, key) for key in LANGUAGE_TOKEN_OPTIONS):
        return None
    return (config_entry(section, "encoder_langtok"),
            bool(config_entry(section, "decoder_langtok")))


LANGUAGE_TOKEN_OPTIONS = ("encoder_langtok", "decoder_langtok")


def config_has(section: Any, key: str) -> bool:
    """Whether a config section (a dict, omegaconf, a Namespace) has ``key``, set or None."""
    return key in section if hasattr(section, "keys") else hasattr(section, key)


def _codes_in(text: str, one_a_line: bool) -> list[str] | None:
    """The language codes of a langs file's ``text``: NLLB's comma-separated line, or
    (``one_a_line``, a --lang-dict file as fairseq reads it) one code a line; None unless
    every entry looks like a language code (a path named by a checkpoint is data: any other
    file's lines must not become a config's list)."""
    if one_a_line and "," not in text:
        codes = [line.strip() for line in text.splitlines() if line.strip()]
    else:
        codes = [code for code in re.split(r"[,\s]+", text) if code]
    return codes if codes and all(_LANGUAGE_CODE.fullmatch(code) for code in codes) else None


def _file_text(path: Any, roots: list[str] | None = None) -> str | None:
    """The text of the file ``path`` (a ``--langs`` or ``--lang-dict``). Without ``roots``
    (the running training's own flags) as given; with them (a checkpoint read from disk
    names the path) only where it lies inside one of them, links resolved: a relative path
    is tried against each in turn, an absolute one must be inside one, so that a crafted
    ``../secret`` is not copied into an export as language codes."""
    if not isinstance(path, str) or not path or "\0" in path:
        return None
    if roots is None:
        tried, roots = [path], ["/"]
    else:
        roots = [os.path.realpath(root) for root in roots]
        tried = [path] if os.path.isabs(path) else [os.path.join(root, path) for root in roots]
    for candidate in tried:
        real = os.path.realpath(candidate)
        inside = any(os.path.commonpath([real, root]) == root for root in roots)
        if inside and os.path.isfile(real) and os.path.getsize(real) <= _LANGS_FILE_LIMIT:
            with open(real, encoding="utf-8", errors="replace") as text:
                return text.read()
    return None


def _training_directory(folder: Path, save_dir: Any) -> Path | None:
    """The directory a training ran in, where ``folder`` (the checkpoint's) still is its
    relative ``--save-dir``: ``/exp`` for ``/exp/checkpoints`` saved as ``checkpoints``."""
    if not isinstance(save_dir, str) or not save_dir or os.path.isabs(save_dir):
        return None
    parts = [part for part in Path(os.path.normpath(save_dir)).parts if part != "."]
    if not parts or ".." in parts or list(folder.parts[-len(parts):]) != parts:
        return None
    return folder.parents[len(parts) - 1]


def _relative_path_bases(state: Any, checkpoint: str | os.PathLike[str] | None) -> list[str]:
    """Where a path stored in a checkpoint's config may be relative to, and the only
    directories it may be read from: the working directory, the checkpoint file's
    directory, and the checkpoint's data directories (``cfg.task.data``, split as fairseq
    splits it; relative ones also from the directory the training ran in, where the file
    is still in its relative save dir) that hold binarised data. The checkpoint names
    those: a directory without ``dict.*.txt`` is no data directory, and the training's
    directory itself is none of them (a crafted save dir makes it ``/`` or a home)."""
    data = []
    for key in ("task", "model"):
        try:
            paths = config_entry(_config_section(state, key), "data")
        except MissingMandatoryValue:  # "???" in a loaded config
            paths = None
        if isinstance(paths, str) and paths and paths != "???":
            data += split_paths(paths)
    bases, data_dirs = [os.getcwd()], list(data)
    if checkpoint is not None:
        folder = Path(os.path.abspath(checkpoint)).parent
        bases.append(str(folder))
        trained_in = _training_directory(
            folder, config_entry(_config_section(state, "checkpoint"), "save_dir"))
        if trained_in is not None:
            data_dirs += [str(trained_in / path) for path in data if not os.path.isabs(path)]
    bases += [path for path in data_dirs
              if glob.glob(os.path.join(glob.escape(path), "dict.*.txt"))]
    return list(dict.fromkeys(bases))


def _names_a_file(langs: str) -> bool:
    """Whether a stored ``langs`` string is a file's path rather than one language's code
    (``en_XX`` for mBART's tasks, which store one code as a string)."""
    return ("/" in langs or os.sep in langs or not _LANGUAGE_CODE.fullmatch(langs)
            or Path(langs).suffix.lower() in {".txt", ".lst", ".list", ".tsv", ".csv"})


def unread_langs_problem(state: Any) -> str | None:
    """What a checkpoint's ``--langs`` path that :func:`languages_as_lists` could not read
    means (``cfg.task.langs`` or ``cfg.model.langs`` still a file's path), else None."""
    for key in ("task", "model"):
        langs = config_entry(_config_section(state, key), "langs")
        if isinstance(langs, str) and "," not in langs and _names_a_file(langs):
            return (f"cfg.{key}.langs holds the path {langs!r} of a --langs file (as earlier "
                    "plugin versions saved it), not found from the working directory, the "
                    "checkpoint's data directories or its own directory")
    return None


def languages_as_lists(state: Any, checkpoint: str | os.PathLike[str] | None = None,
                       warn: bool = True) -> Any:
    """A checkpoint's ``cfg.task.langs`` and ``cfg.model.langs`` as lists of codes, as stock
    fairseq stores them, where they hold a ``--langs`` file's path or a comma-separated
    string (earlier versions of the plugin stored the path), or where only a
    ``--lang-dict`` file's path says which list numbered the language tokens: the nllb
    branch's loader compares the lists and refuses a string, and generation checks the
    order against the list. A relative path is read from the working directory, else
    from the checkpoint's data directories or the directory of the file ``checkpoint``
    it was loaded from (:func:`_relative_path_bases`). A file that is not found, or whose
    text is not a list of language codes, stays a path; ``warn`` says so in one line.
    Works on a saved state (dicts and a Namespace) and on a loaded one (omegaconf)."""
    bases = None if checkpoint is None else _relative_path_bases(state, checkpoint)
    for key in ("task", "model"):
        section = _config_section(state, key)
        langs, lang_dict = config_entry(section, "langs"), config_entry(section, "lang_dict")
        if isinstance(langs, str):
            text = _file_text(langs, bases)
            codes = _codes_in(text if text is not None else langs, one_a_line=False)
            if text is None and "," not in langs:
                codes = None  # one code, or a path to a file that is gone
            changes = {"langs": codes}
        elif langs is None and (text := _file_text(lang_dict, bases)) is not None:
            codes = _codes_in(text, one_a_line=True)
            changes = {"langs": codes, "lang_dict": None}  # stock refuses both at once
        else:
            continue
        if codes is None:
            continue
        if isinstance(section, dict):
            section.update(changes)
        elif isinstance(section, DictConfig):
            with open_dict(section):
                for name, value in changes.items():
                    section[name] = value
        else:  # argparse.Namespace
            for name, value in changes.items():
                setattr(section, name, value)
    problem = unread_langs_problem(state) if warn else None
    if problem is not None:
        where = f"{os.fspath(checkpoint)}: " if checkpoint is not None else ""
        logger.warning(f"{where}{problem}; it stays a path, on which the nllb branch's "
                       "generate stops: give --model-overrides \"{'langs': [...]}\" with the "
                       "training's language list, or run from the directory the path is "
                       "relative to")
    return state


def with_plain_config(state: dict[str, Any]) -> dict[str, Any]:
    """A training checkpoint's ``state`` with its ``cfg`` in plain containers, so that
    ``torch.load(weights_only=True)`` reads it without the plugin. A model config that was
    an ``argparse.Namespace`` (fairseq's legacy architectures read any attribute of it) is
    marked, and :func:`with_model_namespace` makes it one again when the plugin loads the
    file; names and metrics stay as they are (it resumes and generates with
    ``--user-dir``, as any checkpoint that names the plugin's task)."""
    cfg = state.get("cfg")
    if not isinstance(cfg, dict):
        return state
    marked = {MODEL_WAS_NAMESPACE: True} if isinstance(cfg.get("model"),
                                                       argparse.Namespace) else {}
    return {**state, "cfg": plain(cfg), **marked}


def with_model_namespace(state: Any) -> Any:
    """``state`` as fairseq wrote it before :func:`with_plain_config`: a marked model config
    an ``argparse.Namespace`` again."""
    if not isinstance(state, dict) or not state.get(MODEL_WAS_NAMESPACE):
        return state
    state = {key: value for key, value in state.items() if key != MODEL_WAS_NAMESPACE}
    cfg = state.get("cfg")
    if isinstance(cfg, dict) and isinstance(cfg.get("model"), dict):
        state["cfg"] = {**cfg, "model": argparse.Namespace(**cfg["model"])}
    return state


# where a training stood, in fairseq's extra_state: not carried into an export
_TRAINING_POSITION = ("metrics", "train_iterator", "best", "val_loss", "previous_training_time")


def portable_state(state: dict[str, Any],
                   checkpoint: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """``state`` (an inference checkpoint's, tensors untouched) as stock fairseq reads it;
    a ``--langs`` path that cannot be read (:func:`unread_langs_problem`) is left for the
    caller to refuse."""
    state = languages_as_lists(dict(state), checkpoint, warn=False)
    state.pop(MODEL_WAS_NAMESPACE, None)  # its model config stays a dict here
    cfg = state.get("cfg")
    if cfg is None and isinstance(state.get("args"), argparse.Namespace):  # before fairseq 0.10
        from fairseq.dataclass.utils import convert_namespace_to_omegaconf
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(convert_namespace_to_omegaconf(state["args"]))
    cfg = plain(cfg)
    if isinstance(cfg, dict):
        state["args"] = None  # fairseq reads the config from cfg when it is there
        architectures = dict.fromkeys(PLUGIN_ARCHITECTURES, "transformer")
        cfg["task"] = _stock_names(cfg.get("task"), STOCK_TASKS, "_name")
        if isinstance(cfg["task"], dict) and cfg["task"].get("_name") in ARGPARSE_TASKS:
            cfg["task"]["task"] = cfg["task"]["_name"]
        cfg["criterion"] = _stock_names(cfg.get("criterion"), STOCK_CRITERIA, "_name")
        cfg["model"] = _stock_names(cfg.get("model"), {**architectures, **STOCK_TASKS,
                                                       **STOCK_CRITERIA},
                                    "_name", "arch", "task", "criterion")
        if isinstance(cfg.get("common"), dict):
            cfg["common"] = dict(cfg["common"], user_dir=None)
        if isinstance(cfg.get("checkpoint"), dict):  # an export, not a training checkpoint
            # saved without optimizer state (saved_without_optimizer_state)
            cfg["checkpoint"] = dict(cfg["checkpoint"], no_save_optimizer_state=False)
        state["cfg"] = cfg
    extra = state.get("extra_state")
    if isinstance(extra, dict):  # weights, not a place in a training (T2 #2, session 25):
        # stock --restore-file of an export restarted at update 0 yet skipped the batches
        # its source had trained on in that epoch, and carried its best score over
        state["extra_state"] = plain({
            **{k: v for k, v in extra.items() if k not in _TRAINING_POSITION},
            "train_iterator": {"version": 2, "epoch": 1, "iterations_in_epoch": 0}})
    for key in ("optimizer_history", "task_state"):
        if key in state:
            state[key] = plain(state[key])
    return state
