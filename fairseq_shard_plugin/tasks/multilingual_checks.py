"""Checks of the multilingual task's inputs, each a one-line error naming what to change where
fairseq fails later, in a traceback, or not at all.

The order of ``--langs`` numbers the language tokens (``__eng_Latn__`` and the rest are
appended to the dictionary in that order): a checkpoint used with another order, or with
the sorted list fairseq infers from the data when ``--langs`` is not given, reads every
language token as another language, silently. :func:`language_order_problem` compares the
list stored in a checkpoint with the current one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from fairseq import utils
from fairseq.file_io import PathManager

from fairseq_shard_plugin.tasks.multilingual_config import MultilingualOptionError


def _items(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return value.split(",")
    return [str(item) for item in value]


def check_lang_pairs(lang_pairs: Any) -> None:
    """Each ``--lang-pairs`` item is ``SRC-TGT``: two codes joined by one ``-``."""
    for item in _items(lang_pairs):
        parts = item.split("-")
        if len(parts) != 2 or not all(parts) or item != item.strip() or " " in item:
            raise MultilingualOptionError(
                f"--lang-pairs: {item!r} is not SRC-TGT (give comma-separated pairs of "
                "language codes joined by '-', without spaces, e.g. eng_Latn-fra_Latn,"
                "fra_Latn-eng_Latn)")


def check_sampling_temperature(method: Any, temperature: Any) -> None:
    """``--sampling-temperature`` must be above 0 where it is used: fairseq raises its power
    ``1 / T`` (a ZeroDivisionError as the first epoch's data loads, for 0)."""
    if method == "temperature" and not float(temperature) > 0:
        raise MultilingualOptionError(
            f"--sampling-temperature {temperature}: give a temperature above 0 (1 samples "
            "the directions in proportion to their data, larger values flatten the mix "
            "toward uniform)")


def check_langs_files(langs: Any) -> None:
    """A ``--langs`` item that names a file (a path or a ``.txt`` name) must exist: fairseq
    would take the missing file's name for a language code. Files are tested as
    ``read_language_files`` reads them (fairseq's ``PathManager``)."""
    for item in _items(langs):
        item = item.strip()
        if (os.sep in item or item.endswith(".txt")) and not PathManager.isfile(item):
            raise MultilingualOptionError(
                f"--langs {item}: no such file; give the langs file the model was trained "
                "with, or the languages as a comma-separated list")


def language_order_problem(stored: Any, current: Sequence[str] | None) -> str | None:
    """Why a checkpoint trained with languages ``stored`` (its ``cfg.task.langs``) must not
    be used with ``current``, or None. Checkpoints that stored no list, or the file's path
    (written before the list was stored), are not compared."""
    if stored is None or isinstance(stored, str) or current is None:
        return None
    try:  # a list, or OmegaConf's ListConfig once fairseq has upgraded the state
        stored = [str(code) for code in stored]
    except TypeError:
        return None
    current = [str(code) for code in current]
    if stored == current:
        return None
    shown = ",".join(stored)
    if len(shown) > 200:
        shown = f"{shown[:200]}... ({len(stored)} languages)"
    if sorted(stored) == sorted(current):
        difference = "the same languages in another order"
    else:
        missing = [code for code in stored if code not in current]
        added = [code for code in current if code not in stored]
        difference = "; ".join(part for part in (
            f"missing {','.join(missing[:5])}" if missing else "",
            f"not in the checkpoint {','.join(added[:5])}" if added else "") if part)
    return ("the checkpoint's language tokens are numbered by its training's language list "
            "(its --langs, or the sorted languages of its --lang-pairs), and this run's list "
            f"differs ({difference}): give --langs {shown} (the training's langs file or "
            "list; without --langs fairseq sorts the languages it finds)")


def language_tokens_problem(trained: tuple[Any, bool] | None, args: Any) -> str | None:
    """A model trained with language tokens reads other sentences without them (or with
    the target's in place of the source's): it translates, differently, without a word.
    ``trained`` is the checkpoint's (``--encoder-langtok``, ``--decoder-langtok``), None
    where it does not say; ``args`` holds this run's."""
    now = (getattr(args, "encoder_langtok", None), bool(getattr(args, "decoder_langtok", False)))
    if trained is None or trained == now:
        return None

    def flags(tokens: tuple[Any, bool]) -> str:
        return (f"--encoder-langtok {tokens[0] or 'not given'}, --decoder-langtok "
                f"{'given' if tokens[1] else 'not given'}")

    return f"was trained with {flags(trained)}; this run has {flags(now)}"


# what to do about a :func:`language_tokens_problem` where the flags must match
GIVE_THE_LANGUAGE_TOKEN_FLAGS = ("give the training's language-token flags "
                                 "(task.encoder_langtok, task.decoder_langtok)")


def dictionary_mismatch(data: str, lang_pairs: Any) -> str:
    """The dictionaries of the languages of ``lang_pairs`` in DATA's first directory, by
    size, for fairseq's assertion that source languages have different dictionaries."""
    first = utils.split_paths(data)[0]
    sizes = {}
    codes = {code for pair in _items(lang_pairs) for code in pair.split("-") if code}
    for code in sorted(codes):
        path = os.path.join(first, f"dict.{code}.txt")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as lines:
                sizes[os.path.basename(path)] = sum(1 for _ in lines)
    listed = ", ".join(f"{name} {count} lines" for name, count in sorted(sizes.items()))
    return (f"the languages' dictionaries in {first} differ ({listed}): the multilingual "
            "task needs one shared dictionary; binarise every language with the same "
            "--srcdict/--tgtdict (or --joined-dictionary)")
