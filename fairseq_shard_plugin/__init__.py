"""fairseq user dir that makes ``--ddp-backend fully_sharded`` shard per layer and save memory.

Loading it (``--user-dir fairseq_shard_plugin``) registers the plugin's tasks and installs
its trainer; runs with any other ``--ddp-backend`` behave exactly as stock fairseq.
"""

from fairseq_shard_plugin import (  # noqa: F401  (each registers with fairseq)
    chunked_criterion,
    nllb_architectures,
    sharded_multilingual,
    sharded_translation,
)
from fairseq_shard_plugin.integration import install
from fairseq_shard_plugin.safe_loading import allow_fairseq_checkpoint_types

__version__ = "0.1.0"

allow_fairseq_checkpoint_types()
install()
