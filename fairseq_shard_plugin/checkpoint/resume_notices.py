"""What a resume keeps from its checkpoint although the command says otherwise: said once.

fairseq resumes with the optimizer's saved hyper-parameters (its ``param_groups``: Adam's
betas, eps, weight decay), whatever the command gives, unless ``--optimizer-overrides``
names them; and it continues an epoch after the saved number of batches, which under other
batching (``--max-tokens``, ``--batch-size``) or another ``--seed`` are other sentences.
Both are fairseq's semantics and both went unsaid: a new ``--adam-betas`` had no effect
while the next checkpoint's config recorded it, and a new ``--max-tokens`` skipped or
repeated part of the epoch. Each becomes one warning that says what to do instead.
"""

from __future__ import annotations

import ast
from typing import Any

from fairseq_shard_plugin.checkpoint.portable import config_entry, config_has

_BATCHING = ("max_tokens", "batch_size", "required_batch_size_multiple")


def _plain(value: Any) -> Any:
    """A hyper-parameter as compared and shown: lists and tuples as tuples of floats."""
    if isinstance(value, (list, tuple)):
        return tuple(float(item) if isinstance(item, (int, float)) else item for item in value)
    return value


def _overrides(optimizer_overrides: Any) -> dict[str, Any]:
    """What ``--optimizer-overrides`` sets (fairseq evaluates the text as a dict)."""
    try:
        overrides = ast.literal_eval(optimizer_overrides) if isinstance(
            optimizer_overrides, str) else optimizer_overrides
    except (ValueError, SyntaxError):
        return {}
    return dict(overrides) if isinstance(overrides, dict) else {}


def ignored_hyperparameters(state: dict[str, Any], current_group: dict[str, Any],
                            optimizer_overrides: Any, hydra: bool = False) -> str | None:
    """A warning where the checkpoint's optimizer state keeps other values than this run's
    optimizer was built with (its first parameter group ``current_group``), or None; with
    ``hydra``, the override as fairseq-hydra-train takes it."""
    saved_state = state.get("last_optimizer_state")
    groups = saved_state.get("param_groups") if isinstance(saved_state, dict) else None
    if not isinstance(groups, list) or not groups or not isinstance(groups[0], dict):
        return None
    saved, overridden = groups[0], _overrides(optimizer_overrides)
    differing = {key: (_plain(saved[key]), _plain(value)) for key, value in current_group.items()
                 if key not in ("params", "lr", "initial_lr") and key not in overridden
                 and key in saved and isinstance(value, (int, float, tuple, list))
                 and _plain(saved[key]) != _plain(value)}
    if not differing:
        return None
    kept = ", ".join(f"{key} {old}" for key, (old, _) in differing.items())
    given = ", ".join(f"{key} {new}" for key, (_, new) in differing.items())
    overrides = {**overridden, **{key: new for key, (_, new) in differing.items()}}
    verb = "give" if overridden else "add"  # one flag: the given keys stay in it
    setting = (f'"checkpoint.optimizer_overrides=\\"{overrides}\\""' if hydra
               else f"--optimizer-overrides \"{overrides}\"")
    return (f"the checkpoint's optimizer state keeps {kept}, which fairseq resumes with "
            f"(this command gives {given}); to train with the new values, {verb} {setting}")


def changed_batching(state: dict[str, Any], dataset_cfg: Any, seed: Any = None
                     ) -> str | None:
    """A warning where an epoch resumed in its middle is batched (or, with another
    ``seed``, shuffled) otherwise than when it was saved: fairseq continues after the saved
    number of batches, which now hold other sentences; or None."""
    iterator = (state.get("extra_state") or {}).get("train_iterator") if isinstance(
        state.get("extra_state"), dict) else None
    if not isinstance(iterator, dict) or not iterator.get("iterations_in_epoch"):
        return None
    saved_dataset = config_entry(state.get("cfg"), "dataset") or state.get("args")
    if saved_dataset is None:
        return None
    changes = [f"--{key.replace('_', '-')} {before} then, {now} now" for key in _BATCHING
               if config_has(saved_dataset, key)  # None (unset) counts: it batches otherwise
               and (before := config_entry(saved_dataset, key)) != (
                   now := config_entry(dataset_cfg, key))]
    saved_seed = config_entry(config_entry(state.get("cfg"), "common") or state.get("args"),
                              "seed")
    if seed is not None and saved_seed is not None and saved_seed != seed:
        changes.append(f"--seed {saved_seed} then, {seed} now")
    if not changes:
        return None
    return (f"epoch {iterator.get('epoch')} resumes after {iterator['iterations_in_epoch']} "
            f"batches per rank, batched or shuffled otherwise than when saved "
            f"({'; '.join(changes)}): "
            "they are other sentences, so part of the epoch is skipped or seen twice (the "
            "next epochs are whole); the saved batching continues it exactly, "
            "--reset-dataloader starts over at epoch 1")
