"""``fairseq-shard-estimate --config``: the estimator's flags read from a Hydra config.

A ``fairseq-hydra-train`` config names what the estimate depends on in its own groups
(``model``, ``common``, ``optimizer``, ``criterion``, ``dataset``, ``task``,
``distributed_training``); the world size and the vocabulary come from the launcher and
the data, so they stay flags.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

# (group, key in the config) -> the estimator's option
_KEYS = {
    **{("model", name): name for name in (
        "encoder_layers", "decoder_layers", "encoder_embed_dim", "decoder_embed_dim",
        "encoder_ffn_embed_dim", "decoder_ffn_embed_dim", "encoder_attention_heads",
        "decoder_attention_heads", "attention_dropout", "share_all_embeddings",
        "checkpoint_activations")},
    ("model", "_name"): "arch",
    **{("common", name): name for name in (
        "fp16", "bf16", "memory_efficient_fp16", "memory_efficient_bf16")},
    ("optimizer", "_name"): "optimizer",
    ("criterion", "_name"): "criterion",
    ("criterion", "loss_chunk_tokens"): "loss_chunk_tokens",
    ("dataset", "max_tokens"): "max_tokens",
    **{("task", name): name for name in (
        "root_unit_only", "keep_root_gathered", "keep_vocabulary_gathered",
        "reduce_in_16_bit", "reduce_vocabulary_in_16_bit")},
    ("distributed_training", "cpu_offload"): "cpu_offload",
}


def defaults_from_hydra_config(
    path: str, choices: dict[str, Sequence[str]]
) -> dict[str, Any]:
    """The estimator options that the config at ``path`` sets (absent or ``???`` keys are
    left to the flags' defaults), each within its ``choices`` where the estimator has
    them; a config it cannot use raises ``ValueError``."""
    if not Path(path).is_file():
        raise ValueError("no such file")
    try:
        config = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (OmegaConfBaseException, ValueError, yaml.YAMLError) as error:
        raise ValueError(f"not a YAML config ({' '.join(str(error).split())})") from None
    if not isinstance(config, dict):
        raise ValueError("not a fairseq-hydra-train config (groups such as model, common, task)")
    defaults: dict[str, Any] = {}
    for (group, key), option in _KEYS.items():
        values = config.get(group)
        value = values.get(key) if isinstance(values, dict) else None
        if value is None or value == "???":
            continue
        if option in choices and value not in choices[option]:
            raise ValueError(f"{group} {value} is not modelled (one of "
                             f"{', '.join(choices[option])}): pass --{option} instead")
        defaults[option] = value
    return defaults
