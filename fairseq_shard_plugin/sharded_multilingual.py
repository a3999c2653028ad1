"""Task ``sharded_translation_multi_simple_epoch``: fairseq's multilingual task (the NLLB
recipes' task) plus the sharding options. fairseq configures that task with argparse, so
the options are added from the same :class:`ShardingConfig` as ``sharded_translation``'s."""

from typing import Any

from fairseq.tasks import register_task
from fairseq.tasks.translation_multi_simple_epoch import TranslationMultiSimpleEpochTask

from fairseq_shard_plugin.options import add_sharding_args


@register_task("sharded_translation_multi_simple_epoch")
class ShardedTranslationMultiSimpleEpochTask(TranslationMultiSimpleEpochTask):
    """Identical to ``translation_multi_simple_epoch``; its arguments carry the sharding
    options."""

    @staticmethod
    def add_args(parser: Any) -> None:
        TranslationMultiSimpleEpochTask.add_args(parser)
        add_sharding_args(parser)
