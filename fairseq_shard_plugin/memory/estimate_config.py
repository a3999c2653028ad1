"""``fairseq-shard-estimate --config``: the estimator's flags read from a Hydra config.

A ``fairseq-hydra-train`` config holds the settings the estimate depends on under the same
names as the estimator's options, spread over its groups (``model.encoder_layers``,
``common.fp16``, ``dataset.max_tokens``, ``task.keep_vocabulary_gathered``,
``distributed_training.cpu_offload``, ...); a group's ``_name`` selects the arch, the
optimizer or the criterion. The world size and the vocabulary come from the launcher and
the data, so they stay flags, unless the config sets ``distributed_training.
distributed_world_size`` itself (a config for one GPU does: T1 #9, session 25).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

# the option that a group's ``_name`` sets
_NAMED_BY_GROUP = {"model": "arch", "optimizer": "optimizer", "criterion": "criterion"}
# keys named otherwise than the option they set
_RENAMED = {("distributed_training", "distributed_world_size"): "world_size"}


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError("no such file")
    try:
        config = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (OmegaConfBaseException, ValueError, yaml.YAMLError) as error:
        raise ValueError(f"not a YAML config ({' '.join(str(error).split())})") from None
    if not isinstance(config, dict):
        raise ValueError("not a fairseq-hydra-train config (groups such as model, common, task)")
    return config


def _with_its_bases(path: Path) -> dict[str, Any]:
    """The config at ``path`` composed with what its defaults list names, in the list's
    order (``_self_`` last when absent), as Hydra composes: configs of the same directory
    (``- finetune_3_3b``) and of config groups (``- hardware: one_24gb_gpu``, merged at the
    root when the file says ``# @package _global_``, else under the group's name)."""
    config = _read(path)
    entries = list(config.get("defaults") or [])
    if "_self_" not in entries:
        entries.append("_self_")
    composed: dict[str, Any] = {}
    for entry in entries:
        if entry == "_self_":
            part = {key: value for key, value in config.items() if key != "defaults"}
        elif isinstance(entry, str):
            part = _base(path.parent / f"{entry}.yaml", entry)
        elif isinstance(entry, dict) and len(entry) == 1:
            ((group, name),) = entry.items()
            group = str(group).lstrip("+")
            group_file = path.parent / group / f"{name}.yaml"
            part = _base(group_file, f"{group}: {name}")
            with open(group_file) as header:
                if "@package _global_" not in header.readline():
                    part = {group: part}
        else:
            continue
        composed = _merged(composed, part)
    return composed


def _base(path: Path, entry: str) -> dict[str, Any]:
    """A config that a defaults list names as ``entry``, composed with its own bases."""
    if not path.is_file():
        raise ValueError(f"its defaults list names {entry}, but {path} does not exist")
    return _with_its_bases(path)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        merged[key] = (_merged(merged[key], value)
                       if isinstance(value, dict) and isinstance(merged.get(key), dict)
                       else value)
    return merged


def defaults_from_hydra_config(
    path: str, options: dict[str, Sequence[str] | None]
) -> dict[str, Any]:
    """The values the config at ``path`` gives the estimator's ``options`` (each with its
    choices, or None); absent or ``???`` keys are left to the flags' defaults. A config it
    cannot use, or one that sets none of them, raises ``ValueError``."""
    config = _with_its_bases(Path(path))
    defaults: dict[str, Any] = {}
    for group, values in config.items():
        if group == "hydra" or not isinstance(values, dict):
            continue
        for key, value in values.items():
            option = (_NAMED_BY_GROUP.get(group) if key == "_name"
                      else _RENAMED.get((group, key), key))
            if option not in options or value is None or value == "???":
                continue
            if option == "update_freq":  # fairseq's per-epoch list: its largest decides
                values = value if isinstance(value, list) else [value]
                if not all(isinstance(each, int) for each in values):
                    raise ValueError(f"{group}.update_freq {value}: give whole numbers")
                value = max(values, default=1)
            choices = options[option]
            if choices and value not in choices:
                raise ValueError(f"{group} {value} is not modelled (one of "
                                 f"{', '.join(choices)}): pass --{option} instead")
            defaults[option] = value
    if not defaults:  # an estimate of the default model would look like one of this config
        raise ValueError("sets none of the estimator's settings (model._name, "
                         "model.encoder_layers, common.fp16, dataset.max_tokens, ...): give a "
                         "fairseq-hydra-train config such as configs/nllb/dense_600m.yaml")
    return defaults
