"""Task ``sharded_translation_multi_simple_epoch``: fairseq's multilingual task (the NLLB
recipes' task) plus the sharding options, under ``fairseq-train`` and
``fairseq-hydra-train`` alike (its dataclass config: :mod:`.multilingual_config`)."""

from typing import Any

from fairseq.tasks import register_task
from fairseq.tasks.translation_multi_simple_epoch import TranslationMultiSimpleEpochTask

from fairseq_shard_plugin.sharding.options import add_sharding_args
from fairseq_shard_plugin.tasks.multilingual_config import (
    TASK_NAME,
    MultilingualOptionError,
    ShardedMultilingualConfig,
    add_text_options,
    task_namespace,
)


@register_task(TASK_NAME, dataclass=ShardedMultilingualConfig)
class ShardedTranslationMultiSimpleEpochTask(TranslationMultiSimpleEpochTask):
    """Identical to ``translation_multi_simple_epoch``; its config carries the sharding
    options and is converted to the parent's argparse form when the task is set up."""

    @staticmethod
    def add_args(parser: Any) -> None:
        add_text_options(parser)
        add_sharding_args(parser)

    @classmethod
    def setup_task(cls, cfg: Any, **kwargs: Any) -> "ShardedTranslationMultiSimpleEpochTask":
        namespace = task_namespace(cfg)
        try:
            return super().setup_task(namespace, **kwargs)
        except ValueError as error:  # the parent's checks of its options, e.g. no --lang-pairs
            raise MultilingualOptionError(f"{TASK_NAME}: {error}") from error
