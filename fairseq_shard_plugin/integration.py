"""The one place where the plugin reaches into fairseq internals.

Loading the user dir calls :func:`install`. Each hook below says why fairseq's public
extension points (registries, dataclass configs) cannot do the job. Runs that do not use
``--ddp-backend fully_sharded`` take fairseq's own code paths unchanged.

Hooks, in ``fairseq_cli.train`` unless named otherwise:

1. ``fsdp_enable_wrap`` / ``fsdp_wrap``: fairseq wraps the model (and, inside this context,
   each layer above ``--min-params-to-wrap``) in fairscale FSDP while building it, with no
   registry to choose another wrapper. The plugin leaves the model unwrapped here and
   shards it by its own wrap policy when the trainer is built.
2. ``Trainer``: ``train.py`` constructs ``fairseq.trainer.Trainer`` by name; under
   ``fully_sharded`` it becomes :class:`~fairseq_shard_plugin.trainer.ShardedTrainer`.
3. ``fairseq.logging.meters.MaxMeter``: fairseq restores logged meters from checkpoints by
   looking their class names up in that module, so the plugin's per-step peak-memory meter
   is made findable there; otherwise resuming would fail on its name.
4. ``distributed_utils.call_main``: fairseq derives world size and device from CUDA, which
   breaks torchrun on CPU (see ``launch_env``); the wrapper also drops the ``--tpu`` that
   fairseq's parser implies from ``--bf16``, rejects unworkable sharded configurations
   with a one-line error before any process group or data is touched, and turns a
   checkpoint that cannot be loaded into a one-line error naming the file and the mismatch.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import fairseq
import fairseq.distributed.utils as distributed_utils
import fairseq.logging.meters as fairseq_meters
import fairseq_cli.train as train_cli

from fairseq_shard_plugin.checkpoint_errors import CheckpointLoadError
from fairseq_shard_plugin.launch_env import apply_torchrun_environment
from fairseq_shard_plugin.memory_metrics import MaxMeter
from fairseq_shard_plugin.precision import untie_bf16_from_tpu
from fairseq_shard_plugin.validation import (
    ShardingConfigError,
    check_sharded_config,
    is_sharded_run,
)

_HOOKED_NAMES = ("fsdp_enable_wrap", "fsdp_wrap", "Trainer")
_INSTALLED_MARK = "_fairseq_shard_plugin_installed"


@contextlib.contextmanager
def _no_fairscale_wrapping(distributed_cfg: Any) -> Iterator[None]:
    """Replaces ``fsdp_enable_wrap``: build plain layers; sharding happens in the trainer."""
    yield


def _leave_unwrapped(module: Any, **kwargs: Any) -> Any:
    """Replaces ``fsdp_wrap`` for the root model: no fairscale wrapper around it."""
    return module


def _select_trainer(stock_trainer: type) -> Callable[..., Any]:
    def make_trainer(cfg: Any, task: Any, model: Any, criterion: Any, quantizer: Any = None) -> Any:
        if is_sharded_run(cfg):
            from fairseq_shard_plugin.trainer import ShardedTrainer

            return ShardedTrainer(cfg, task, model, criterion, quantizer)
        return stock_trainer(cfg, task, model, criterion, quantizer)

    return make_trainer


def _with_launcher_environment(stock_call_main: Callable[..., Any]) -> Callable[..., Any]:
    def call_main(cfg: Any, main: Callable[..., Any], **kwargs: Any) -> Any:
        apply_torchrun_environment(cfg)
        if not is_sharded_run(cfg):
            return stock_call_main(cfg, main, **kwargs)
        untie_bf16_from_tpu(cfg)
        try:
            check_sharded_config(cfg)
            return stock_call_main(cfg, main, **kwargs)
        except (ShardingConfigError, CheckpointLoadError) as error:
            sys.exit(f"fairseq-shard-plugin: error: {error}")

    call_main.__wrapped__ = stock_call_main  # type: ignore[attr-defined]
    return call_main


def _train_modules() -> list[Any]:
    """``fairseq_cli.train``, and ``__main__`` when run as ``python -m fairseq_cli.train``."""
    modules = [train_cli]
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", "")
    if main is not None and spec_name == train_cli.__name__:
        modules.append(main)
    return modules


def install() -> None:
    """Install the hooks once; fail clearly on a fairseq without the expected names."""
    missing = [name for name in _HOOKED_NAMES if not hasattr(train_cli, name)]
    if not hasattr(distributed_utils, "call_main"):
        missing.append("fairseq.distributed.utils.call_main")
    if missing:
        raise ImportError(
            f"fairseq_shard_plugin does not support fairseq {fairseq.__version__}: "
            f"missing {', '.join(missing)} (supported: fairseq 0.12.x and its nllb branch)"
        )
    for module in _train_modules():
        if getattr(module, _INSTALLED_MARK, False):
            continue
        module.fsdp_enable_wrap = _no_fairscale_wrapping
        module.fsdp_wrap = _leave_unwrapped
        module.Trainer = _select_trainer(module.Trainer)
        setattr(module, _INSTALLED_MARK, True)
    fairseq_meters.MaxMeter = MaxMeter
    if not hasattr(distributed_utils.call_main, "__wrapped__"):
        distributed_utils.call_main = _with_launcher_environment(distributed_utils.call_main)
