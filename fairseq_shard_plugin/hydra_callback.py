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

import difflib
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, ValidationError

from fairseq_shard_plugin.checkpoint.portable import PLUGIN_KEYS
from fairseq_shard_plugin.errors import exit_with, prints_here
from fairseq_shard_plugin.hydra_keys import fixed_groups


class LoadShardPlugin(Callback):
    """Activates the plugin (registrations and :func:`~.fairseq_integration.install`) at job
    start."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        import fairseq_shard_plugin

        fairseq_shard_plugin.activate_or_exit()
        problem = (first_unresolvable(config) or unknown_group_key(config)
                   or invalid_component_value(config))
        if problem:  # the same on every rank: one line a node
            exit_with(f"fairseq-shard-plugin: error: {problem}", print_it=prints_here())


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


def unknown_group_key(config: DictConfig) -> str | None:
    """One line for the first key of fairseq's fixed groups (``optimization``,
    ``checkpoint``, ``dataset``, ``common``, ...) that the group's dataclass does not have:
    Hydra's ``+`` adds any key, and fairseq ignored a misspelt one
    (``+optimization.max_updates=3`` trained to the config's own max_update, T1 #2)."""
    import dataclasses

    from fairseq.dataclass.configs import FairseqConfig

    groups = [group.name for group in dataclasses.fields(FairseqConfig)]
    keys = {group: [field.name for field in dataclasses.fields(kind)]
            for group, kind in fixed_groups().items()}
    for key in config:  # a misspelt group, or a key without one (T4 #3, session 25)
        if key in groups or key == "hydra":
            continue
        owners = [f"{group}.{key}" for group, known in keys.items() if key in known]
        close = owners or difflib.get_close_matches(str(key), groups, n=1, cutoff=0.7)
        hint = f": did you mean {close[0]}?" if close else ""
        return f"{key}: not a group of fairseq's config{hint}"
    for group, known in keys.items():
        node = config.get(group)
        for key in node if isinstance(node, DictConfig) else ():
            if str(key) not in known:
                close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.7)
                hint = f": did you mean {group}.{close[0]}?" if close else ""
                return f"{group}.{key}: not an option of fairseq's {group}{hint}"
    return None


def invalid_component_value(config: DictConfig) -> str | None:
    """One line for the first ``task.*``, ``criterion.*``, ``optimizer.*`` or
    ``lr_scheduler.*`` key its component's registered dataclass does not have (a typo, as
    ``+task.shard_enigne=fsdp2`` or in a copied YAML, with the closest key named), or whose
    value has the wrong type or lies outside its choices (``task.layers_per_unit=abc``,
    ``task.shard_engine=fsdp3``), interpolations resolved first; fairseq would stop on it
    with omegaconf's traceback when it merges the defaults."""
    for section, registry in _registries():
        problem = _invalid_value(config, section, registry)
        if problem:
            return problem
    return None


def _registries() -> list[tuple[str, dict[str, Any]]]:
    from fairseq.criterions import CRITERION_DATACLASS_REGISTRY
    from fairseq.optim import OPTIMIZER_DATACLASS_REGISTRY
    from fairseq.optim.lr_scheduler import LR_SCHEDULER_DATACLASS_REGISTRY
    from fairseq.tasks import TASK_DATACLASS_REGISTRY

    return [("task", TASK_DATACLASS_REGISTRY), ("criterion", CRITERION_DATACLASS_REGISTRY),
            ("optimizer", OPTIMIZER_DATACLASS_REGISTRY),
            ("lr_scheduler", LR_SCHEDULER_DATACLASS_REGISTRY)]


def _invalid_value(config: DictConfig, section: str, registry: dict[str, Any]) -> str | None:
    node = config.get(section)
    name = node.get("_name") if isinstance(node, DictConfig) else None
    if name not in registry:
        return None
    given = OmegaConf.to_container(node, resolve=True)  # (first_unresolvable ran first)
    given.pop("_name", None)
    fields = OmegaConf.structured(registry[name])
    try:
        OmegaConf.merge(fields, given)
    except ConfigKeyError as error:
        key = str(getattr(error, "key", "") or "")
        close = difflib.get_close_matches(key, [str(k) for k in fields], n=1, cutoff=0.7)
        hint = (f": did you mean {section}.{close[0]}?" if close
                else f": an option of the plugin's tasks, not of {name} (task._name="
                "sharded_translation or sharded_translation_multi_simple_epoch carries it)"
                if section == "task" and key in PLUGIN_KEYS else "")
        return f"{section}.{key}: not an option of {section} {name}{hint}"
    except ValidationError as error:
        where = f"{section}.{error.key}" if getattr(error, "key", None) else section
        reason = str(error).strip().splitlines()[0]
        return f"{where}: {reason}"
    except Exception:  # anything else is fairseq's (and Hydra's) to report
        return None
    return None
