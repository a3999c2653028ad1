"""Task ``sharded_translation``: fairseq's ``translation`` plus the sharding options."""


from dataclasses import dataclass

from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from fairseq_shard_plugin.options import ShardingConfig


@dataclass
class ShardedTranslationConfig(TranslationConfig, ShardingConfig):
    """``translation``'s options and the plugin's sharding options."""


@register_task("sharded_translation", dataclass=ShardedTranslationConfig)
class ShardedTranslationTask(TranslationTask):
    """Identical to ``translation``; its config carries the sharding options."""
