"""``fairseq-shard-estimate --config``: the estimator's flags read from a Hydra config.

A ``fairseq-hydra-train`` config holds the settings the estimate depends on under the same
names as the estimator's options, spread over its groups (``model.encoder_layers``,
``common.fp16``, ``dataset.max_tokens``, ``task.keep_vocabulary_gathered``,
``distributed_training.cpu_offload``, ...); a group's ``_name`` selects the arch, the
optimizer or the criterion. The world size and the vocabulary come from the launcher and
the data, so they stay flags.
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


def defaults_from_hydra_config(
    path: str, options: dict[str, Sequence[str] | None]
) -> dict[str, Any]:
    """The values the config at ``path`` gives the estimator's ``options`` (each with its
    choices, or None); absent or ``???`` keys are left to the flags' defaults. A config it
    cannot use raises ``ValueError``."""
    if not Path(path).is_file():
        raise ValueError("no such file")
    try:
        config = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (OmegaConfBaseException, ValueError, yaml.YAMLError) as error:
        raise ValueError(f"not a YAML config ({' '.join(str(error).split())})") from None
    if not isinstance(config, dict):
        raise ValueError("not a fairseq-hydra-train config (groups such as model, common, task)")
    defaults: dict[str, Any] = {}
    for group, values in config.items():
        if group == "hydra" or not isinstance(values, dict):
            continue
        for key, value in values.items():
            option = _NAMED_BY_GROUP.get(group) if key == "_name" else key
            if option not in options or value is None or value == "???":
                continue
            choices = options[option]
            if choices and value not in choices:
                raise ValueError(f"{group} {value} is not modelled (one of "
                                 f"{', '.join(choices)}): pass --{option} instead")
            defaults[option] = value
    return defaults
