"""Engines apply a :class:`~fairseq_shard_plugin.wrap_policy.ShardingPlan`; no policy here."""
