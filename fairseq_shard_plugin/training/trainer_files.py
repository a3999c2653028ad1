"""The trainer's checkpoint I/O: full (gathered) or sharded (DCP) state, written crash-safely."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fairseq import utils

from fairseq_shard_plugin.checkpoint.atomic_files import remove_partial_files, write_atomically
from fairseq_shard_plugin.checkpoint.errors import (
    RESET_OPTIMIZER,
    CheckpointLoadError,
    describe_shape_mismatch,
    in_save_dir,
    state_dict_shapes,
    tensor_shapes,
)
from fairseq_shard_plugin.checkpoint.fairscale_sets import (
    is_fairscale_state,
    is_rank_file_state,
    read_rank_file,
    saved_world_size,
)
from fairseq_shard_plugin.checkpoint.fairscale_shards import consolidated_state, in_model_order
from fairseq_shard_plugin.checkpoint.integrity import corruption_message, damaged_zip_entries
from fairseq_shard_plugin.checkpoint.portable import (
    config_entry,
    languages_numbering_the_tokens,
    saved_without_optimizer_state,
    stored_language_tokens,
)
from fairseq_shard_plugin.checkpoint.reading import read_checkpoint
from fairseq_shard_plugin.checkpoint.resume_notices import changed_batching, ignored_hyperparameters
from fairseq_shard_plugin.checkpoint.sharded import (
    SHARDED_KEY,
    ShardedCheckpointError,
    empty_like_saved,
    fill_tensors,
    is_sharded_index,
    load_tensors,
    read_shard_metadata,
    remove_unreferenced_shards,
    save_sharded,
    saved_shapes,
    tensor_paths,
)
from fairseq_shard_plugin.checkpoint.stock_optimizer_state import (
    adopt_stock_optimizer_state,
    layout_problem,
)
from fairseq_shard_plugin.hydra_keys import as_written, running_under_hydra
from fairseq_shard_plugin.run_hooks import checkpoint_read
from fairseq_shard_plugin.sharding.full_state import share_tied_tensors, tied_parameter_names
from fairseq_shard_plugin.sharding.options import checkpoint_format
from fairseq_shard_plugin.tasks.multilingual_checks import (
    GIVE_THE_LANGUAGE_TOKEN_FLAGS,
    language_order_problem,
    language_tokens_problem,
)

logger = logging.getLogger(__name__)


def save_full_checkpoint(
    trainer: Any, filename: str, extra_state: dict[str, Any], training_finished: bool = False
) -> str:
    """Write ``trainer.state_dict()`` plus ``extra_state`` to ``filename``; return its path.

    The caller is the rank that writes (rank 0); ``state_dict`` gathers full tensors,
    a collective the other ranks join from fairseq's ``save_checkpoint``. The file appears
    under its name only once complete (``atomic_files``), so a crash mid-write leaves the
    previous checkpoint of that name in place.
    """
    path = os.path.abspath(filename)
    logger.info(f"Saving checkpoint to {path}")
    state = _on_cpu_once(trainer.state_dict(filename, training_finished))
    state["extra_state"].update(extra_state)
    checkpoint_cfg = trainer.cfg.checkpoint
    held = in_save_dir(path, checkpoint_cfg.save_dir)
    best = re.escape(checkpoint_cfg.best_checkpoint_metric)  # (checkpoint.best_loss_9.123)
    written = re.compile(rf"checkpoint(_last|_best|[0-9]+|_[0-9]+_[0-9]+|\.best_{best}_-?[0-9.]+)"
                         + re.escape(checkpoint_cfg.checkpoint_suffix or "") + r"\.pt")
    for leftover in remove_partial_files(  # the save dir is this run's (save_dir_claim)
            os.path.dirname(path), lambda name: held and written.fullmatch(name) is not None):
        logger.warning(f"removed {leftover}, left by a save that was interrupted")
    write_atomically(path, lambda out: torch.save(state, out))
    logger.info(f"Finished saving checkpoint to {path}")
    return path


def _on_cpu_once(state: dict[str, Any]) -> dict[str, Any]:
    """fairseq's ``utils.move_to_cpu`` (16-bit tensors widened to fp32), except that a tensor
    found under several names (a tied embedding and output projection) is moved and widened
    once, so the checkpoint stores it once: fairseq's own widens each name separately."""
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in moved:  # the tensor is kept too, so that its id stays its own
            widened = (tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16)
                       else tensor)
            moved[id(tensor)] = (tensor, widened.cpu())
        return moved[id(tensor)][1]

    return utils.apply_to_sample(move, state)


def checkpoint_state(trainer: Any, stock_state: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The trainer's checkpoint state: full tensors, or (sharded format) an index after DCP
    has written this rank's shards. A collective: every rank calls it at each save."""
    state = stock_state()
    state["model"] = share_tied_tensors(state["model"], trainer.model)  # stored once
    if checkpoint_format(trainer.cfg) == "sharded":
        return save_sharded(state, trainer.cfg.checkpoint.save_dir, trainer.get_num_updates())
    return trainer.engine.full_state(state, trainer.optimizer.optimizer)


def after_save(trainer: Any) -> None:
    """On the saving rank, after a save (once fairseq has copied and pruned names) and
    before the first update: drop the shard directories no checkpoint refers to (keeping
    the one the run was restored from, whose index may live elsewhere)."""
    for directory in remove_unreferenced_shards(trainer.cfg.checkpoint.save_dir, _read_index,
                                                getattr(trainer, "loaded_shards", None)):
        logger.info(f"removed {directory}: no checkpoint refers to it any more")


def _read_index(path: Path) -> Any:
    return read_checkpoint(path)


def read_sharded_index(filename: str) -> dict[str, Any] | None:
    """The index if ``filename`` is a readable sharded checkpoint, else None."""
    try:
        state = _read_index(Path(filename))
    except Exception:  # missing or unreadable: fairseq's own loading reports it
        return None
    return state if is_sharded_index(state) else None


def verify_full_checkpoint(filename: str) -> None:
    """Collective: refuse a full checkpoint whose bytes fail their CRC-32 (each rank checks
    a share of the entries); missing and unreadable files are left to the loader."""
    if os.path.isfile(filename):
        damaged = damaged_zip_entries(Path(filename), collective=True)
        if damaged:
            raise CheckpointLoadError(corruption_message(filename, damaged))


class _OtherLanguages(CheckpointLoadError):
    """Another language list than the checkpoint's: it numbers the tokens, and an extra
    language also changes the vocabulary's shape, which this names the cause of."""


def trainer_state_loader(
    trainer: Any, reset_optimizer: bool,
    record_saved_ranks: Callable[[dict[str, Any], int], None],
    on_fresh_optimizer: Callable[[], None] = lambda: None,
) -> Callable[[str, dict[str, Any]], dict[str, Any]]:
    """For fairseq's loader (hook 6): the state the trainer loads from a checkpoint's contents.

    A sharded index becomes a state whose tensors are this rank's shards (see
    :func:`_load_shards`); one rank's file of stock fairseq's sharded state becomes the
    whole set's full state (``fairscale_shards``); a full checkpoint written without the
    plugin has its optimizer state adopted when it fits (``stock_optimizer_state``). A file
    without optimizer state is refused unless the optimizer is reset (a fine-tune) or its
    own run chose not to save it (``--no-save-optimizer-state``): that run continues with a
    fresh optimizer, and ``on_fresh_optimizer`` is called for the trainer to restore the
    update count and schedule that fairseq restores only with optimizer state.
    ``record_saved_ranks`` notes in the extra state how many ranks saved a stock
    ``fully_sharded`` checkpoint (its config says; the trainer then converts the data
    position for this run's ranks).
    """

    def load(filename: str, state: dict[str, Any]) -> dict[str, Any]:
        fresh_optimizer = not reset_optimizer and saved_without_optimizer_state(state)
        if fresh_optimizer:
            on_fresh_optimizer()
        if fresh_optimizer and getattr(trainer, "is_data_parallel_master", False):
            logger.warning(
                f"{filename}: its run saved no optimizer state (--no-save-optimizer-state): "
                f"continuing at its update ({state['optimizer_history'][-1]['num_updates']}; "
                "fairseq's line below says 0) with its weights, data position and "
                "learning-rate schedule, and a fresh optimizer (Adam's moments start again "
                "from zero)")
        skip_optimizer = reset_optimizer or fresh_optimizer
        if not skip_optimizer and "last_optimizer_state" not in state:
            raise CheckpointLoadError(
                f"{filename}: holds no optimizer state (an export for inference?), so a "
                "resume would restart at update 0 and overwrite this save dir's checkpoints "
                f"of those updates: to train from its weights, give --finetune-from-model "
                f"{filename} (or --reset-optimizer); to resume, restore a training "
                "checkpoint (fairseq-shard-verify --newest SAVE_DIR names one)")
        if not skip_optimizer:
            _refuse_another_optimizer(filename, state, trainer.cfg.optimizer)
            _take_the_same_loss(filename, state, type(trainer.get_criterion()).__name__)
        if getattr(trainer, "is_data_parallel_master", False):  # (None: state checks only)
            _say_what_the_resume_keeps(trainer, skip_optimizer, filename, state)
        read = checkpoint_read()  # hook 6 noted the list before reading a stored path
        problem = language_order_problem(
            read.languages if read is not None and read.path == str(filename)
            else languages_numbering_the_tokens(state),
            getattr(getattr(trainer, "task", None), "langs", None))
        if problem:  # a multilingual checkpoint resumed or fine-tuned with other languages
            raise _OtherLanguages(f"{filename}: {problem}")
        _same_language_tokens(trainer, filename, state, reset_optimizer)
        if is_fairscale_state(state) and isinstance(state.get("extra_state"), dict):
            record_saved_ranks(state["extra_state"], saved_world_size(filename, state))
        if is_rank_file_state(state):
            state = _whole_fairscale_set(trainer, skip_optimizer, filename, state)
        elif is_fairscale_state(state) and not skip_optimizer:  # full; its optimizer state
            state = in_model_order(filename, state, _optimizer_param_names(trainer))  # by unit
        if is_sharded_index(state):
            state = _load_shards(trainer, skip_optimizer, filename, state)
        elif not skip_optimizer:
            optimizer = trainer.optimizer
            inner = getattr(optimizer, "fp32_optimizer", optimizer)
            adopt_stock_optimizer_state(filename, state, type(optimizer).__name__,
                                        type(inner).__name__, [p.shape for p in optimizer.params])
        if not skip_optimizer and trainer.settings.engine == "fsdp2":
            # every optimizer it takes keeps per-element state of its parameter's full
            # shape (the fairscale engine's flat parameters are laid out differently)
            _refuse_misfit_optimizer_state(filename, state, trainer.optimizer.params,
                                           trainer.cfg.model)
        return state

    def load_naming_the_model_first(filename: str, state: dict[str, Any]) -> dict[str, Any]:
        try:
            return load(filename, state)
        except _OtherLanguages:  # the cause of any shape difference of the vocabulary
            raise
        except CheckpointLoadError:  # optimizer state of another model: the model is why
            saved, model = state.get("model"), getattr(trainer, "_model", None)
            if isinstance(saved, dict) and model is not None and not (
                    is_sharded_index(state) or is_rank_file_state(state)):
                problem = describe_shape_mismatch(filename, tensor_shapes(saved),
                                                  state_dict_shapes(model))
                if problem:
                    raise CheckpointLoadError(problem) from None
            raise

    return load_naming_the_model_first


def _same_language_tokens(trainer: Any, filename: str, state: dict[str, Any],
                          reset_optimizer: bool) -> None:
    """A multilingual run resumed under other language-token flags trains on other input
    sentences and damages the model, silently (T3 #2): refused; a fine-tune (a reset
    optimizer) may mean it, so it is told once."""
    task = getattr(trainer, "task", None)
    if not getattr(task, "langs", None):  # not the multilingual task
        return
    problem = language_tokens_problem(stored_language_tokens(state), task.args)
    fine_tune = reset_optimizer or filename == trainer.cfg.checkpoint.finetune_from_model
    if problem and not fine_tune:
        raise CheckpointLoadError(f"{filename} {problem}: {GIVE_THE_LANGUAGE_TOKEN_FLAGS}")
    if problem and trainer.is_data_parallel_master:
        logger.warning(f"{filename} {problem}: the fine-tune learns the new ones from the "
                       "checkpoint's weights")


def _optimizer_param_names(trainer: Any) -> list[str]:
    """The model's names of the optimizer's parameters, in the optimizer's order."""
    names = {id(param): name for name, param in trainer.model.named_parameters()}
    return [names.get(id(param), f"(parameter {index} of the optimizer, outside the model)")
            for index, param in enumerate(trainer.optimizer.params)]


def _whole_fairscale_set(trainer: Any, reset_optimizer: bool, filename: str,
                         state: dict[str, Any]) -> dict[str, Any]:
    """Stock fairseq's per-rank files (``--use-sharded-state``) as one full state, each
    file read and CRC-checked like a full checkpoint."""
    model = trainer.model
    param_names = None if reset_optimizer else _optimizer_param_names(trainer)
    whole = consolidated_state(filename, state, read_rank_file, state_dict_shapes(model),
                               param_names, tied_parameter_names(model))
    logger.info(f"{filename}: fairseq's fully_sharded state of "
                f"{saved_world_size(filename, state)} ranks "
                "(fairscale's flat shards), put together into whole parameters"
                + ("" if reset_optimizer else " and per-parameter optimizer state"))
    return whole


def _refuse_misfit_optimizer_state(filename: str, state: dict[str, Any],
                                   params: list[torch.Tensor], model_cfg: Any) -> None:
    """Optimizer state of other shapes (another model's, a file edited by hand) fails only at
    the first step, in a traceback on every rank: refuse it before anything is loaded,
    naming the tie flags where they differ (the weights load either way: same names and
    shapes, tied or not)."""
    problem = layout_problem(state.get("last_optimizer_state") or {},
                             [param.shape for param in params])
    if not problem:
        return
    ties = _tie_differences(state, model_cfg)
    if ties:
        raise CheckpointLoadError(
            f"{filename}: its model shares parameters differently from this one "
            f"({'; '.join(ties)}), so its optimizer state does not fit ({problem}): resume "
            "with the saved run's flags, or train this model from its weights with "
            f"--finetune-from-model {filename} and a new --save-dir")
    raise CheckpointLoadError(
        f"{filename}: its optimizer state does not fit this model's parameters "
        f"({problem}); {RESET_OPTIMIZER}")


def _refuse_another_optimizer(filename: str, state: dict[str, Any], optimizer_cfg: Any) -> None:
    """The state of another --optimizer (Adam's moments for NAG) failed at the first step, in
    the other optimizer's KeyError: the saved config names the optimizer that wrote it."""
    saved = (config_entry(config_entry(state.get("cfg"), "optimizer"), "_name")
             or config_entry(state.get("args"), "optimizer"))
    now = config_entry(optimizer_cfg, "_name")
    if "last_optimizer_state" in state and saved and now and saved != now:
        raise CheckpointLoadError(
            f"{filename}: its optimizer state is --optimizer {saved}'s, this run has "
            f"--optimizer {now}; {RESET_OPTIMIZER}")


def _say_what_the_resume_keeps(trainer: Any, reset_optimizer: bool, filename: str,
                               state: dict[str, Any]) -> None:
    """Warn where fairseq resumes with saved values the command changed (``resume_notices``):
    the optimizer's hyper-parameters, an epoch's position under other batching."""
    checkpoint_cfg, hydra = trainer.cfg.checkpoint, running_under_hydra()
    groups = None if reset_optimizer else getattr(trainer.optimizer, "param_groups", None)
    notices = [
        groups and ignored_hyperparameters(state, groups[0],
                                           checkpoint_cfg.optimizer_overrides, hydra),
        None if checkpoint_cfg.reset_dataloader
        or filename == getattr(checkpoint_cfg, "finetune_from_model", None)
        else changed_batching(state, trainer.cfg.dataset, trainer.cfg.common.seed)]
    for notice in notices:
        if notice:
            logger.warning(f"{filename}: {as_written(notice, trainer.cfg)}")


# the plugin's chunked criterion computes the stock one's loss, and neither keeps state
_SAME_LOSS = frozenset({"LabelSmoothedCrossEntropyCriterion",
                        "ChunkedLabelSmoothedCrossEntropyCriterion"})


def _take_the_same_loss(filename: str, state: dict[str, Any], criterion: str) -> None:
    """fairseq resumes only under the criterion class named in the checkpoint, and asks for
    --reset-optimizer otherwise (which restarts at update 0 and saves over the save dir's
    checkpoints). Where the two compute the same loss the resume continues; else the line
    names both and the safe way to train on."""
    history = state.get("optimizer_history")
    last = history[-1] if isinstance(history, list) and history else None
    saved = last.get("criterion_name") if isinstance(last, dict) else None
    if not isinstance(saved, str) or saved == criterion:
        return
    if {saved, criterion} <= _SAME_LOSS:
        last["criterion_name"] = criterion  # type: ignore[index]
        return
    raise CheckpointLoadError(f"{filename}: it was trained with the criterion {saved}, this "
                              f"run has {criterion}; {RESET_OPTIMIZER}")


_TIE_FLAGS = ("share_all_embeddings", "share_decoder_input_output_embed",
              "share_input_output_embed")


def _tie_differences(state: dict[str, Any], model_cfg: Any) -> list[str]:
    """The tie flags the checkpoint's model config and ``model_cfg`` set differently."""
    saved = config_entry(state.get("cfg"), "model") or state.get("args")

    def on(value: Any) -> str:
        return "on" if value else "off"

    return [f"--{flag.replace('_', '-')} {on(before)} in the checkpoint, {on(now)} now"
            for flag in _TIE_FLAGS
            if bool(before := config_entry(saved, flag))
            != bool(now := getattr(model_cfg, flag, None))]


def _load_shards(
    trainer: Any, reset_optimizer: bool, filename: str, index: dict[str, Any]
) -> dict[str, Any]:
    """A sharded index as a state whose tensors are this rank's shards (collective).

    Checks names and shapes against the model first, then reads every shard into fresh
    tensors (DCP reshards to this world size); the model is touched only after all of it
    succeeded, by fairseq's own ``load_state_dict``.
    """
    entries = read_shard_metadata(filename, index, collective=True)
    model_state = trainer.model.state_dict()
    shapes = {name: tuple(t.shape) for name, t in model_state.items()}
    problem = describe_shape_mismatch(filename, saved_shapes(index, entries, "model"), shapes)
    if problem:
        raise ShardedCheckpointError(problem)
    skeleton = {k: v for k, v in index.items() if k != SHARDED_KEY}
    if reset_optimizer:
        skeleton.pop("last_optimizer_state", None)
    params = list(trainer.optimizer.params)
    targets = {}
    for path in tensor_paths(skeleton):
        parts = path.split("/")
        like = None
        if parts[0] == "model":
            like = model_state.get(path[len("model/"):])
        elif parts[:2] == ["last_optimizer_state", "state"] and int(parts[2]) < len(params):
            like = params[int(parts[2])]
        targets[path] = empty_like_saved(entries[path], like)
    load_tensors(filename, index, targets)
    return fill_tensors(skeleton, targets)
