"""Task ``sharded_translation_multi_simple_epoch``: fairseq's multilingual task (the NLLB
recipes' task) plus the sharding options, under ``fairseq-train`` and
``fairseq-hydra-train`` alike (its dataclass config: :mod:`.multilingual_config`).

Two things of the nllb branch also work on fairseq 0.12, so that a released NLLB-200
checkpoint's vocabulary (256,206 rows) can be rebuilt for ``--finetune-from-model``:
``--add-data-source-prefix-tags`` (the data-source tags appended to the dictionary after
the language tokens) and ``--langs langs.txt`` with NLLB's one-line, comma-separated file.
"""

import logging
import re
from pathlib import Path
from typing import Any

import torch.distributed as dist
from fairseq.file_io import PathManager
from fairseq.tasks import register_task
from fairseq.tasks.translation_multi_simple_epoch import TranslationMultiSimpleEpochTask
from omegaconf import DictConfig, open_dict

from fairseq_shard_plugin.run_hooks import checkpoint_read
from fairseq_shard_plugin.sharding.options import add_sharding_args
from fairseq_shard_plugin.tasks.checkpoint_match import MatchingTheCheckpoint
from fairseq_shard_plugin.tasks.multilingual_checks import (
    GIVE_THE_LANGUAGE_TOKEN_FLAGS,
    check_lang_pairs,
    check_langs_files,
    check_sampling_temperature,
    dictionary_mismatch,
    language_order_problem,
    language_tokens_problem,
)
from fairseq_shard_plugin.tasks.multilingual_config import (
    DATA_SOURCE_PREFIX_TAGS,
    TASK_NAME,
    MultilingualOptionError,
    ShardedMultilingualConfig,
    add_text_options,
    fairseq_adds_prefix_tags,
    task_namespace,
)
from fairseq_shard_plugin.tasks.sharded_translation import check_data_directory

logger = logging.getLogger(__name__)


def _language_codes(text: str) -> list[str]:
    """Language codes separated by commas or whitespace (NLLB's langs.txt is one
    comma-separated line; a --lang-dict file has one code a line)."""
    return [code for code in re.split(r"[,\s]+", text) if code]


def _read_if_file(item: str) -> str:
    if PathManager.isfile(item):
        with PathManager.open(item) as f:
            return f.read()
    return item


def read_language_files(namespace: Any) -> Any:
    """``--langs`` may name a file, as the nllb branch reads it (fairseq 0.12 only splits
    the text at commas); a ``--lang-dict`` file holding NLLB's comma-separated line becomes
    that list (fairseq would read it as one language). Anything else is left as is."""
    langs = namespace.langs
    if langs:
        items = [langs] if isinstance(langs, str) else [str(item) for item in langs]
        namespace.langs = [code for item in items for code in _language_codes(
            _read_if_file(item))]
    lang_dict = getattr(namespace, "lang_dict", None)
    if lang_dict and not langs and PathManager.isfile(lang_dict):
        text = _read_if_file(lang_dict)
        if "," in text:
            namespace.langs, namespace.lang_dict = _language_codes(text), None
    return namespace


def add_prefix_tags(dicts: Any) -> None:
    """Append the data-source tags to each distinct dictionary, as the nllb branch's
    ``augment_dictionary`` does after the language tokens (and ``<mask>``, where added)."""
    for dictionary in {id(d): d for d in dicts}.values():
        for tag in DATA_SOURCE_PREFIX_TAGS.values():
            dictionary.add_symbol(tag)


def check_the_checkpoints_languages(task: TranslationMultiSimpleEpochTask, cfg: Any) -> None:
    """A model built from a checkpoint (generation) must have been trained with ``task``'s
    language order and language-token flags, where the checkpoint says which
    (``portable.languages_numbering_the_tokens``). Also run for fairseq's own
    ``translation_multi_simple_epoch`` while the plugin is loaded (integration hook 13)."""
    read = checkpoint_read()
    if read is None:  # not read through fairseq's loader: its model config says
        problem = language_order_problem(getattr(cfg, "langs", None), task.langs)
        if problem:
            raise MultilingualOptionError(problem)
        return
    problem = language_order_problem(read.languages, task.langs)
    if problem:
        raise MultilingualOptionError(f"{read.path}: {problem}")
    tokens = language_tokens_problem(read.language_tokens, task.args)
    if tokens:
        raise MultilingualOptionError(f"{read.path} {tokens}: {GIVE_THE_LANGUAGE_TOKEN_FLAGS}")


@register_task(TASK_NAME, dataclass=ShardedMultilingualConfig)
class ShardedTranslationMultiSimpleEpochTask(MatchingTheCheckpoint,
                                             TranslationMultiSimpleEpochTask):
    """Identical to ``translation_multi_simple_epoch``; its config carries the sharding
    options and is converted to the parent's argparse form when the task is set up."""

    @staticmethod
    def add_args(parser: Any) -> None:
        add_text_options(parser)
        add_sharding_args(parser)

    @classmethod
    def setup_task(cls, cfg: Any, **kwargs: Any) -> "ShardedTranslationMultiSimpleEpochTask":
        namespace = task_namespace(cfg)
        check_langs_files(namespace.langs)
        check_lang_pairs(namespace.lang_pairs)
        check_sampling_temperature(namespace.sampling_method, namespace.sampling_temperature)
        if namespace.data:
            check_data_directory(namespace.data)
        namespace = read_language_files(namespace)
        if isinstance(namespace.langs, list) and isinstance(cfg, DictConfig):
            with open_dict(cfg):  # saved with the checkpoint: the list, as stock stores it
                cfg.langs = list(namespace.langs)
        try:
            return super().setup_task(namespace, **kwargs)
        except ValueError as error:  # the parent's checks of its options, e.g. no --lang-pairs
            raise MultilingualOptionError(f"{TASK_NAME}: {error}") from error
        except AssertionError as error:  # fairseq's spelling
            if "Diffrent dictionary" not in str(error) and "Different dictionary" not in str(
                    error):
                raise
            raise MultilingualOptionError(
                dictionary_mismatch(namespace.data, namespace.lang_pairs)) from None

    def build_model(self, cfg: Any, from_checkpoint: bool = False) -> Any:
        """The model, checked against its checkpoint's languages (generation)."""
        if from_checkpoint:
            check_the_checkpoints_languages(self, cfg)
        return super().build_model(cfg, from_checkpoint)

    def load_dataset(self, split: str, epoch: int = 1, combine: bool = False,
                     **kwargs: Any) -> Any:
        try:
            loaded = super().load_dataset(split, epoch, combine, **kwargs)
        except KeyError as error:  # fairseq's data manager, on a direction without files
            key = error.args[0] if error.args else None
            if not (isinstance(key, str) and ":" in key):
                raise
            direction = key.split(":", 1)[1]
            if self._has_data(split, direction):  # the data is there: the weights lack it
                if not getattr(self.args, "sampling_weights", None):
                    raise
                raise MultilingualOptionError(
                    f"--sampling-weights gives no weight for {key!r} (it holds "
                    f"{self.args.sampling_weights!r}): name every direction trained as "
                    f"DATA_SOURCE:SRC-TGT, as {key!r} (a key with ':' in a Hydra override: "
                    f"quote the whole dictionary, task.sampling_weights=\"{{'{key}': 1.0}}\")"
                ) from None
            raise MultilingualOptionError(
                f"no {split} data for {direction} in {self.args.data} (its {split}.{direction}"
                ".* files, or the reverse direction's): remove it from --lang-pairs, or "
                "binarise it") from None
        if split == self.args.train_subset and not getattr(self, "_train_loaded", False):
            self._train_loaded = True  # this process's first epoch: a resume if epoch > 1
            self._warn_of_a_redrawn_round(epoch)
        return loaded

    def _warn_of_a_redrawn_round(self, epoch: int) -> None:
        """fairseq draws the sentence order of a round of virtual epochs once, in its first
        epoch, seeded by that epoch; a process resumed in a later epoch of the round draws
        it anew, seeded by its own epoch, so it trains other sentences (T3 #1: not exact at
        a virtual epoch's end either)."""
        rounds = getattr(self.datasets.get(self.args.train_subset), "num_virtual_epochs", 1)
        if rounds > 1 and (epoch - 1) % rounds and (
                not dist.is_initialized() or dist.get_rank() == 0):
            logger.warning(
                f"resumed in epoch {epoch}, virtual epoch {(epoch - 1) % rounds + 1} of a round "
                f"of {rounds} (--virtual-epoch-size): fairseq draws a round's sentence order "
                "in the round's first epoch, and a resumed process draws it again from this "
                "epoch, so the rest of the round trains other sentences than an uninterrupted "
                "run would (in stock fairseq too); resumes in a round's first epoch are exact")

    def _has_data(self, split: str, direction: str) -> bool:
        """Whether a data directory holds ``split`` files of ``direction`` or its reverse."""
        source, _, target = direction.partition("-")
        names = (f"{split}.{source}-{target}.*", f"{split}.{target}-{source}.*")
        return any(any(Path(folder).glob(name)) for folder in str(self.args.data).split(":")
                   for name in names)

    def __init__(self, args: Any, langs: list[str], dicts: Any, training: bool) -> None:
        # The parent's setup_task has loaded each dictionary and appended the language
        # tokens; the tags come last, before anything reads the dictionaries.
        if getattr(args, "add_data_source_prefix_tags", False) and not fairseq_adds_prefix_tags():
            add_prefix_tags(dicts.values())
            logger.info("added the data-source tags %s: dictionary of %d types",
                        ",".join(DATA_SOURCE_PREFIX_TAGS.values()),
                        len(next(iter(dicts.values()))))
            folds = [s for s in str(getattr(args, "train_subset", "")).split(",")
                     if s.startswith("train_") and s[len("train_"):] in DATA_SOURCE_PREFIX_TAGS]
            if folds:
                logger.warning(
                    "--add-data-source-prefix-tags on this fairseq adds the tags to the "
                    "dictionary only: sentences of %s are not prefixed with them as on "
                    "fairseq's nllb branch", ",".join(folds))
        super().__init__(args, langs, dicts, training)
