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
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, ValidationError


class LoadShardPlugin(Callback):
    """Activates the plugin (registrations and :func:`~.fairseq_integration.install`) at job
    start."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        import fairseq_shard_plugin

        fairseq_shard_plugin.activate_or_exit()
        problem = first_unresolvable(config) or invalid_task_value(config)
        if problem:
            raise SystemExit(f"fairseq-shard-plugin: error: {problem}")


def first_unresolvable(config: DictConfig) -> str | None:
    """One line for the first key of the job's config (Hydra's own node aside) whose value
    cannot be resolved, e.g. ``${oc.env:FINETUNE_FROM_MODEL}`` with the variable unset;
    fairseq-hydra-train would stop on it with omegaconf's traceback."""
    for key in config:
        try:
            section = None if key == "hydra" else config.get(key)
            if isinstance(section, (DictConfig, ListConfig)):
                OmegaConf.to_container(section, resolve=True)
        except InterpolationResolutionError as error:
            where = getattr(error, "full_key", None) or key
            reason = str(error).strip().splitlines()[0]
            return (f"{where}: {reason}; give it on the command line ({where}=...) or set "
                    "what it refers to")
    return None


def invalid_task_value(config: DictConfig) -> str | None:
    """One line for a ``task.*`` value of the wrong type or outside its choices (for
    example ``task.layers_per_unit=abc``, ``task.shard_engine=fsdp3``), checked against
    the task's registered dataclass; fairseq would stop on it with omegaconf's traceback
    when it merges the task's defaults."""
    from fairseq.tasks import TASK_DATACLASS_REGISTRY

    task = config.get("task")
    name = task.get("_name") if isinstance(task, DictConfig) else None
    if name not in TASK_DATACLASS_REGISTRY:
        return None
    given = OmegaConf.to_container(task, resolve=False)
    given.pop("_name", None)
    try:
        OmegaConf.merge(OmegaConf.structured(TASK_DATACLASS_REGISTRY[name]), given)
    except ValidationError as error:
        where = f"task.{error.key}" if getattr(error, "key", None) else "task"
        reason = str(error).strip().splitlines()[0]
        return f"{where}: {reason}"
    except Exception:  # anything else is fairseq's (and Hydra's) to report
        return None
    return None
