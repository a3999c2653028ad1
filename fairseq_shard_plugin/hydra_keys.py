"""Errors in the names a ``fairseq-hydra-train`` user writes: config keys, not flags.

The plugin's one-line errors name ``fairseq-train``'s flags (``--layers-per-unit 0: give 1
...``). Under Hydra the same setting is ``task.layers_per_unit``, so before such a line is
printed :func:`in_hydra_keys` writes every flag that is a key of the job's config as that
key. A key fairseq interpolates into several groups (``seed`` into ``task``, ``lr`` into
``optimizer``) is named in the group that owns it: fairseq's fixed groups (``common``,
``dataset``, ``checkpoint``, ...) before the component ones (``task``, ``model``, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping
from typing import Any

_OPENING = re.compile(r"(--[a-z0-9][a-z0-9-]*) [^\s:]+:")  # "--flag VALUE: ..."
_FLAG = re.compile(r"(?<![\w\-/.])--([a-z0-9][a-z0-9-]*)")  # not inside a path


def running_under_hydra() -> bool:
    """Whether this process is a Hydra job (``fairseq-hydra-train``)."""
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return False
    return HydraConfig.initialized()


def fixed_groups() -> dict[str, type]:
    """fairseq's config groups whose keys are declared in ``FairseqConfig`` itself, each
    with its dataclass, in its order (the component groups' keys depend on the task, model,
    ... chosen)."""
    from fairseq.dataclass.configs import FairseqConfig

    groups = {}
    for field in dataclasses.fields(FairseqConfig):
        kind = field.type if dataclasses.is_dataclass(field.type) else field.default_factory
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            groups[field.name] = kind
    return groups


def config_keys_by_flag(cfg: Mapping[str, Any]) -> dict[str, str]:
    """``--flag-name`` -> ``group.flag_name`` for every key of the config's groups."""
    fixed = list(fixed_groups())
    groups = [*fixed, *(name for name in cfg if name not in fixed)]
    keys: dict[str, str] = {}
    for group in groups:
        for key in _keys_of(cfg.get(group)):
            if isinstance(key, str) and not key.startswith("_"):
                keys.setdefault("--" + key.replace("_", "-"), f"{group}.{key}")
    # the flags that choose a component: its group's _name (T1 #6, session 25)
    for flag, group in _CHOOSING.items():
        if group in cfg:
            keys[flag] = f"{group}._name"
    return keys


_CHOOSING = {"--task": "task", "--criterion": "criterion", "--optimizer": "optimizer",
             "--lr-scheduler": "lr_scheduler", "--arch": "model"}


def _keys_of(section: Any) -> list[Any]:
    """A group's keys: a mapping's (DictConfig), or a Namespace's (a model of fairseq's
    older architectures), else none."""
    if isinstance(section, argparse.Namespace):
        return list(vars(section))
    return list(section.keys()) if hasattr(section, "keys") else []


def as_written(message: str, cfg: Mapping[str, Any]) -> str:
    """``message`` in the names the user wrote: Hydra's keys in a Hydra job
    (:func:`in_hydra_keys`), else as it is (fairseq-train's flags)."""
    return in_hydra_keys(message, cfg) if running_under_hydra() else message


def in_hydra_keys(message: str, cfg: Mapping[str, Any]) -> str:
    """``message`` with each flag that names a key of ``cfg`` written as that key; a line
    that opens with a flag and its value (``--layers-per-unit 0: ...``) opens with the
    override as Hydra reads it (``task.layers_per_unit=0: ...``)."""
    keys = config_keys_by_flag(cfg)
    opening = _OPENING.match(message)
    if opening and opening.group(1) in keys:
        message = f"{keys[opening.group(1)]}={message[len(opening.group(1)) + 1:]}"
    return _FLAG.sub(lambda found: keys.get(found.group(0), found.group(0)), message)
