"""Task ``sharded_translation``: fairseq's ``translation`` plus the sharding options."""


import glob
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from fairseq import utils
from fairseq.data import data_utils
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from fairseq_shard_plugin.errors import ShardPluginError
from fairseq_shard_plugin.sharding.options import ShardingConfig
from fairseq_shard_plugin.tasks.checkpoint_match import MatchingTheCheckpoint
from fairseq_shard_plugin.tasks.resumable_batches import EpochIndependentBatches


@dataclass
class ShardedTranslationConfig(TranslationConfig, ShardingConfig):
    """``translation``'s options and the plugin's sharding options."""


logger = logging.getLogger(__name__)


class DataPathError(ShardPluginError, ValueError):
    """A DATA argument that is not a binarised fairseq directory; says which one to give."""

    node_wide = True


def check_data_directory(data: str) -> None:
    """DATA's first directory must hold fairseq-preprocess's ``dict.*.txt``; otherwise one
    line saying what to pass (fairseq says "Could not infer language pair", or fails on
    the missing directory with a traceback)."""
    first = utils.split_paths(data)[0]
    if "://" in first:  # remote storage: fairseq's PathManager reads it
        return
    if not os.path.isdir(first):
        where = "" if os.path.isabs(first) else f" in {os.getcwd()}, the working directory"
        raise DataPathError(f"the data directory {first}: no such directory{where}: give the "
                            "directory fairseq-preprocess wrote (fairseq-shard-synthetic-data "
                            "OUT writes it to OUT/bin)")
    if glob.glob(os.path.join(glob.escape(first), "dict.*.txt")):
        return
    inner = os.path.join(first, "bin")
    if glob.glob(os.path.join(glob.escape(inner), "dict.*.txt")):
        raise DataPathError(f"the data directory {first} holds the binarised data in "
                            f"{inner}: pass {inner}")
    raise DataPathError(f"the data directory {first} holds no dict.*.txt: give the "
                        "directory fairseq-preprocess wrote (its --destdir)")


def one_of_several_pairs(cfg: Any) -> str | None:
    """A warning when DATA holds several language pairs and the task was given neither
    --source-lang nor --target-lang: fairseq's translation task trains on the first pair
    it lists, alone (configs/nllb/tiny.yaml on a multilingual DATA trained one of six
    directions without a word, T3 #9)."""
    if cfg.source_lang or cfg.target_lang:
        return None
    first = utils.split_paths(cfg.data)[0]
    if "://" in first or not os.path.isdir(first):
        return None
    pairs = sorted({match[1] for name in os.listdir(first)
                    if (match := re.fullmatch(r"train\.([^.]+-[^.]+)\.[^.]+\.idx", name))})
    if len(pairs) < 2:
        return None
    source, target = data_utils.infer_language_pair(first)
    return (f"DATA {first} holds {len(pairs)} language pairs ({', '.join(pairs)}) and no "
            f"--source-lang/--target-lang is given: the translation task trains on "
            f"{source}-{target} alone; for all of them use --task "
            "sharded_translation_multi_simple_epoch (fairseq-hydra-train: +corpus=multilingual)")


@register_task("sharded_translation", dataclass=ShardedTranslationConfig)
class ShardedTranslationTask(EpochIndependentBatches, MatchingTheCheckpoint, TranslationTask):
    """``translation`` whose config carries the sharding options, and whose batches do not
    depend on the epoch a training resumed in (:mod:`.resumable_batches`); a DATA that is
    not binarised data is named in one line (:func:`check_data_directory`), and a model
    built for a checkpoint is checked against it (:mod:`.checkpoint_match`)."""

    @classmethod
    def setup_task(cls, cfg: Any, **kwargs: Any) -> "ShardedTranslationTask":
        check_data_directory(cfg.data)
        several = one_of_several_pairs(cfg)
        if several and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.warning(several)
        return super().setup_task(cfg, **kwargs)
