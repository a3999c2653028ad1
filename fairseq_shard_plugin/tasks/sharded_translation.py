"""Task ``sharded_translation``: fairseq's ``translation`` plus the sharding options."""


from dataclasses import dataclass

from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from fairseq_shard_plugin.sharding.options import ShardingConfig
from fairseq_shard_plugin.tasks.resumable_batches import EpochIndependentBatches


@dataclass
class ShardedTranslationConfig(TranslationConfig, ShardingConfig):
    """``translation``'s options and the plugin's sharding options."""


@register_task("sharded_translation", dataclass=ShardedTranslationConfig)
class ShardedTranslationTask(EpochIndependentBatches, TranslationTask):
    """``translation`` whose config carries the sharding options, and whose batches do not
    depend on the epoch a training resumed in (:mod:`.resumable_batches`)."""
