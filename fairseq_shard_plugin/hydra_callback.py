"""Load the plugin before ``fairseq-hydra-train`` launches its ranks.

``fairseq-hydra-train`` imports ``common.user_dir`` only inside ``fairseq_cli.train.main``,
after it has chosen how to launch: the plugin's launch and export hooks
(:mod:`.fairseq_integration`, hook 4) would come too late. Hydra runs the callbacks a config
names before the job itself, so the plugin's configs name this one:

.. code-block:: yaml

    hydra:
      callbacks:
        fairseq_shard_plugin:
          _target_: fairseq_shard_plugin.hydra_callback.LoadShardPlugin

Without it, training still works (the trainer joins torchrun's process group itself), but
``task.export_consolidated`` is refused and bad options stop with a traceback.
"""

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class LoadShardPlugin(Callback):
    """Activates the plugin (registrations and :func:`~.fairseq_integration.install`) at job
    start."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        import fairseq_shard_plugin

        fairseq_shard_plugin.activate_or_exit()
