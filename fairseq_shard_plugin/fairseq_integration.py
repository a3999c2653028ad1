"""The one module that installs hooks into fairseq's modules.

Loading the user dir calls :func:`install` (through the package's ``activate``). Each hook
below says why fairseq's public extension points (registries, dataclass configs) cannot do
the job. Runs that do not use ``--ddp-backend fully_sharded`` take fairseq's own code paths
unchanged. The plugin reaches into fairseq in two other ways, listed in
docs/architecture.md ("How the plugin reaches into fairseq"): ``ShardedTrainer``
(:mod:`.training.trainer`) subclasses fairseq's ``Trainer`` and overrides two of its
private methods, and a few modules set fairseq config values at run time.

Hooks, in ``fairseq_cli.train`` unless named otherwise:

1. ``fsdp_enable_wrap`` / ``fsdp_wrap``: fairseq wraps the model (and, inside this context,
   each layer above ``--min-params-to-wrap``) in fairscale FSDP while building it, with no
   registry to choose another wrapper. The plugin leaves the model unwrapped here and
   shards it by its own wrap policy when the trainer is built. Where the transformer
   layer builders (``transformer_encoder``, ``transformer_decoder``) call ``fsdp_wrap``,
   a sharded training's layer is sharded right away, as fairseq builds it (with the
   settings hook 4 records; under ``--layers-per-unit N`` once N layers of its stack
   exist), so no rank ever holds the whole fp32 model. Inside the context, a random fill
   of a parameter already sharded draws the whole parameter (``sharding.sharded_init``):
   BART draws every weight again once its layers exist.
2. ``Trainer``: ``train.py`` constructs ``fairseq.trainer.Trainer`` by name; under
   ``fully_sharded`` it becomes :class:`~fairseq_shard_plugin.training.trainer.ShardedTrainer`.
   Before either is built (the first place that holds both), the plugin's chunked
   criterion refuses a model it cannot compute its loss for.
   Under any other backend it stays fairseq's, subclassed only so that ``load_checkpoint``
   ends by copying what it keeps out of the mapped checkpoint file (hook 6 maps it; see
   ``training.private_state``): torch's optimizer keeps the loaded moments themselves; and
   so that every rank reads the file (rank 0's broadcast of fairseq's loaded config cannot
   be unpickled under torch >= 2.6); its ``state_dict`` stores a ``--langs`` file's codes,
   not its path, as the plugin's trainer does (the language checks compare that list).
   ``ShardedTrainer`` overrides two of the Trainer's private methods, for want of public ones:
   ``_build_optimizer`` (the optimizer steps on fp32 master shards) and
   ``_reduce_and_log_stats`` (an fp16 update skipped for overflow logs nothing, as in
   fairseq, whose own skip path calls ``.cuda()`` and so cannot run on CPU ranks); it also
   sets the Trainer's ``cuda_env`` aside, because ``train_step`` resets CUDA's peak memory
   statistics through it before the plugin could read the step's peak.
3. ``fairseq.logging.meters.MaxMeter``: fairseq restores logged meters from checkpoints by
   looking their class names up in that module, so the plugin's per-step peak-memory meter
   is made findable there; otherwise resuming would fail on its name.
4. ``distributed_utils.call_main``: fairseq derives world size and device from CUDA, which
   breaks torchrun on CPU (see ``launch_env``); the wrapper also drops the ``--tpu`` that
   fairseq's parser implies from ``--bf16``, takes fairseq's ``--use-sharded-state`` as the
   plugin's sharded format (cleared, so fairseq's ``-shard0`` names are never used),
   sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` for sharded CUDA runs where
   the user has not configured the allocator (it is read when CUDA starts, which happens
   inside fairseq's function), rejects unworkable sharded configurations (and a save dir
   whose checkpoints fairseq would train over from scratch, having lost its
   ``checkpoint_last.pt``) with a one-line error before any process group or data is
   touched, and turns a checkpoint that cannot be loaded into a one-line error naming the
   file and the mismatch (and, on a rank whose peer's process ended, gloo's traceback into
   a line pointing at that rank: ``training.peer_ended``). Under ``--export-consolidated
   PATH`` it also runs, after training on rank 0, the export of the final
   ``checkpoint_last.pt`` (fairseq's ``main`` has no end-of-training hook; every rank
   learns how it went), unless a signal stopped the training (hook 9). Every rank first
   joins rank 0 in holding the save dir for the training (``checkpoint.save_dir_claim``:
   one training per save dir, the same directory on every rank), before fairseq's
   ``main`` reads or writes anything there.
   ``fairseq-hydra-train`` imports ``common.user_dir`` inside ``main``, after this call:
   there the plugin's Hydra callback (``hydra_callback``) activates the plugin at job start.
5. ``checkpoint_utils.save_checkpoint``: fairseq writes the first checkpoint name through
   ``Trainer.save_checkpoint`` (atomic in the plugin's trainer) and then copies it to the
   other names (``checkpoint_last.pt``, ``checkpoint_best.pt``) with
   ``PathManager.copy``, which truncates and rewrites the destination in place: a crash
   during that copy leaves a half-written ``checkpoint_last.pt`` that resume then picks.
   A copy in place also changes the pages of a file a running training has mapped (hook
   6). There is no option or hook for the copy, so for every run the wrapper runs fairseq's
   function with its module's ``PathManager`` replaced by one whose local copies go
   through a temporary file and ``os.replace`` (``atomic_files``); everything else,
   including which names are written and which old ones are removed, stays fairseq's.
   Afterwards the trainer's ``after_checkpoint_save`` runs on the saving rank (it deletes
   shard directories of ``--checkpoint-format sharded`` that no name refers to any more).
6. ``checkpoint_utils.load_checkpoint_to_cpu``: every fairseq loader (the Trainer's resume,
   ``fairseq-generate``, ``from_pretrained``) reads checkpoints through it. A sharded
   checkpoint's file is an index whose tensors live in a DCP directory
   (``checkpoint.sharded``); the wrapper replaces those references by tensors: the
   trainer's shards (collective, resharded to this world size) while the trainer loads,
   full tensors read in one process otherwise. While the trainer loads, a full checkpoint
   written without the plugin also has its optimizer entry relabelled for the sharded
   optimizer when its state fits (fairseq's Trainer asserts the class names match and has
   no hook in between; ``stock_optimizer_state``; and, while fairseq's own trainer loads
   under another backend, the plugin's optimizer entry for fairseq's optimizer), and one
   rank's file of stock
   ``fully_sharded``'s per-rank state becomes the whole set's full state
   (``fairscale_shards``). Every load also gets ``langs`` as a
   list where an earlier version saved the ``--langs`` file's path (the nllb branch's
   loader refuses the string; the list is noted for the multilingual task, which checks it
   as fairseq builds that checkpoint's model from the model config alone, where a Hydra
   run's checkpoint has no ``langs``; the tensors' shapes are noted too, so that the
   plugin's tasks name a dictionary that differs in one line: ``tasks.checkpoint_match``),
   and the model config as the ``argparse.Namespace``
   fairseq's legacy architectures expect where the plugin wrote it as a dict (so that
   ``torch.load(weights_only=True)`` reads the file without the plugin:
   ``portable.with_plain_config``). Outside the sharded trainer (which names it with the
   model at hand), a file it cannot read (neither torch format, a refused pickle, a
   structure no checkpoint has) is one line, not a traceback of ``fairseq-generate``, and
   a full checkpoint's CRC-32s are checked first, as the trainer checks them (a changed byte
   translated differently without a word; a truncated file is named).
   Other loads pass through unchanged.
   fairseq 0.12 reads the file through an open file object (``torch.load(f)``), which
   copies the whole checkpoint into each process's own memory: N ranks of a host held N
   copies of released weights. While the wrapper runs fairseq's function, the ``torch``
   that function sees maps a zip-format checkpoint instead (``mmap=True``,
   ``weights_only=True``; a legacy-format file is read): its pages are page cache, shared
   by the host's ranks (:class:`_TorchMappingCheckpoints`). The model's tensors are copied
   into the model by every fairseq loader; what a trainer keeps is copied out of the file
   after its load (hook 2), so no rewrite of the file can reach a running training.
7. ``checkpoint_utils.torch_load_cpu`` (fairseq's nllb branch only): it casts every
   checkpoint's model to fp16 when the checkpoint's config says ``--fp16`` or
   ``--memory-efficient-fp16``. The plugin's checkpoints hold fp32 master weights under
   those flags, so a resume would round the masters (and a sharded index, holding shard
   references instead of tensors, would fail). The replacement maps the file with
   ``weights_only=True`` (as hook 6 does) and skips the cast while the trainer loads and
   for sharded indexes; other loads (inference) keep the branch's cast.
8. ``fairseq.utils.import_user_module``: the nllb branch's version raises ImportError for a
   user dir whose package is already imported (0.12 skips it), which is exactly the case
   under ``fairseq-hydra-train`` once the plugin's Hydra callback has imported it. The
   wrapper skips the plugin's own package when it is given as user dir; other user dirs go
   to fairseq's function.
9. ``validate_and_save``: fairseq's training loop calls it on every rank after every
   update to decide whether to validate, save and stop; nothing else runs there on all
   ranks at once, and fairseq has no notion of a signal asking for a save. The wrapper
   first asks the trainer's ``signal_stop`` (one all-reduce) whether any rank received a
   ``--save-on-signal`` signal; if one did, every rank saves through fairseq's own
   ``save_checkpoint`` (so ``checkpoint_last.pt`` and fairseq's other names are written as
   usual) without validating (except at an epoch's end, where the epoch's validation is
   due and a resume would start the next epoch), and the loop stops. Hook 4 then exits
   with 128 + the signal's number instead of exporting (torchrun's error file says so). A
   signal during the last update (``--max-update``, the last epoch's) changes nothing.
   Where fairseq's rules would leave no checkpoint to resume from or to export (a signal
   under ``--no-last-checkpoints``; the last epoch between two ``--save-interval`` saves
   with ``--export-consolidated``), the wrapper saves anyway (``training.final_saves``).

10. ``eval`` in fairseq's convolutional model modules (``fconv``, ``fconv_lm``,
    ``fconv_self_att``, ``lightconv_lm``, ``transformer_lm``): their ``build_model`` turns
    layer-spec strings of the model config into lists with Python's ``eval``, and a
    checkpoint carries that config, so loading a stranger's checkpoint (fairseq-generate,
    ``from_pretrained``, a resume) would run whatever the strings say. There is no option
    for it; a module-level name ``eval`` in those modules shadows the builtin, and the
    plugin's (``checkpoint.literal_specs``) evaluates literals joined by ``+`` and ``*``
    only. Speech models' feature-extractor specs still go through the builtin.

11. ``argparse.ArgumentParser.error``, for fairseq's commands' parsers only (``fairseq-*``
    with ``--user-dir``): fairseq's parser answers a mistyped flag with its whole usage (186
    lines for ``fairseq-train``), once per rank under torchrun or srun. Once the plugin is
    loaded (it is imported while fairseq parses, before the final parse), the mistake is one
    line from the launcher's rank 0, with the closest option when there is one (``did you mean
    --keep-vocabulary-gathered?``), else argparse's list of the choices, or the tasks that
    carry a plugin option given to another task (fairseq's ``--help`` lists no task's
    options), and the same exit status 2; other parsers keep argparse's behaviour.

12. ``checkpoint_utils.verify_checkpoint_directory``: fairseq's ``main`` calls it on its
    master rank to create the save dir and probe it with a file named ``dummy``. Where the
    plugin arrives inside ``main`` (``fairseq-hydra-train`` with ``common.user_dir`` and
    without the plugin's Hydra callback), hook 4 has not told fairseq the ranks yet, so
    every rank believes it is the master and they create and remove the same file at
    once: one of them fails with ``FileNotFoundError: .../dummy``. The wrapper runs the
    check only on the rank the launcher numbered 0 (torchrun's ``RANK``, srun's
    ``SLURM_PROCID``); without a launcher, as fairseq does. A save dir that cannot be
    written ends the run in one line there, instead of fairseq's traceback.

13. ``TranslationMultiSimpleEpochTask.build_model`` (``fairseq.tasks``): with the plugin
    loaded (it reads the sharded index), generation under fairseq's own task name with
    another ``--langs`` order or other language-token flags than the training's translated
    differently, exit status 0. Built from a checkpoint, the stock task's model is checked
    as the plugin's task checks its own (``tasks.sharded_multilingual``): one line naming
    the training's values. Its ``setup_task`` too: the stock task takes ``--langs`` as a
    comma list only, and a langs file (as the plugin's task and docs take it) ended in
    fairseq's "not in the language dictionary" traceback; one line says what to give.

Signatures that differ between fairseq 0.12 and the nllb branch (extra keyword arguments of
``fsdp_enable_wrap``, ``save_checkpoint``, ``load_checkpoint_to_cpu``, ``Trainer.state_dict``
and ``Trainer.save_checkpoint``) are passed through, so both work.

Installing twice (the user dir imported again) wraps nothing twice: the plugin's wrappers
carry a mark of their own (``_fairseq_shard_plugin_hook``), and the hooks of
``fairseq_cli.train`` a mark on the module. Another ``functools.wraps`` wrapper already in
place (a profiler's, another plugin's) is wrapped like fairseq's own function. A fairseq
that lacks one of the replaced names, or has it as something not callable, stops the import
with one line naming its version.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import logging
import os
import pickle
import re
import signal
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import fairseq
import fairseq.checkpoint_utils as checkpoint_utils
import fairseq.distributed.utils as distributed_utils
import fairseq.logging.meters as fairseq_meters
import fairseq.utils as fairseq_utils
import fairseq_cli.train as train_cli
import torch.distributed as dist
from fairseq.file_io import PathManager

from fairseq_shard_plugin import names_this_plugin
from fairseq_shard_plugin.checkpoint.atomic_files import (
    WriteError,
    copy_atomically,
    describe_os_error,
)
from fairseq_shard_plugin.checkpoint.errors import (
    CheckpointLoadError,
    describe_unreadable,
    save_failure,
    tensor_shapes,
)
from fairseq_shard_plugin.checkpoint.integrity import RESUME_HINT
from fairseq_shard_plugin.checkpoint.portable import (
    languages_as_lists,
    languages_numbering_the_tokens,
    stored_language_tokens,
    with_model_namespace,
)
from fairseq_shard_plugin.checkpoint.reading import NotACheckpointError, read_checkpoint
from fairseq_shard_plugin.checkpoint.stock_optimizer_state import give_to_stock_optimizer
from fairseq_shard_plugin.errors import (
    ShardPluginError,
    exit_with,
    prints_here,
    tell_the_launcher,
)
from fairseq_shard_plugin.hydra_keys import as_written
from fairseq_shard_plugin.memory.host_allocator import return_freed_blocks
from fairseq_shard_plugin.memory.metrics import MaxMeter
from fairseq_shard_plugin.run_hooks import (
    CheckpointRead,
    active_trainer_loader,
    note_checkpoint_read,
    settings_of_training,
    stock_trainer_optimizer,
)
from fairseq_shard_plugin.sharding.options import (
    SHARDING_FLAGS,
    options_given,
    take_use_sharded_state,
)
from fairseq_shard_plugin.sharding.precision import untie_bf16_from_tpu
from fairseq_shard_plugin.sharding.settings import launcher_rank, warn_once
from fairseq_shard_plugin.tasks.chunked_criterion import (
    CHUNKED_CRITERION,
    CHUNKED_CRITERION_FLAGS,
)
from fairseq_shard_plugin.training.final_saves import (
    config_for_a_signal_save,
    ends_without_a_save,
)
from fairseq_shard_plugin.training.launch_env import (
    apply_torchrun_environment,
    default_allocator_setting,
    uses_cuda,
)
from fairseq_shard_plugin.training.peer_ended import peer_ended_line
from fairseq_shard_plugin.training.private_state import with_private_loaded_state
from fairseq_shard_plugin.training.train_then_export import TrainThenExport, first_failure
from fairseq_shard_plugin.training.validation import (
    check_a_lost_last_checkpoint,
    check_any_backend,
    check_batch_size,
    check_chunked_validation,
    check_sharded_config,
    finetune_not_loaded,
    is_sharded_run,
    reset_flags_given,
)

logger = logging.getLogger(__name__)

_HOOKED_NAMES = ("fsdp_enable_wrap", "fsdp_wrap", "Trainer", "validate_and_save")
_INSTALLED_MARK = "_fairseq_shard_plugin_installed"
# Set on the plugin's own wrappers of fairseq functions, so that install() wraps each
# function once: a ``__wrapped__`` alone would also match a profiler's or another
# plugin's ``functools.wraps`` wrapper, which must be wrapped, not taken for the plugin's.
_HOOK_MARK = "_fairseq_shard_plugin_hook"

_Wrapper = Callable[..., Any]


def _marked(wrapper: _Wrapper, stock: _Wrapper) -> _Wrapper:
    """``wrapper`` (which replaces ``stock``) marked as the plugin's hook."""
    wrapper.__wrapped__ = stock  # type: ignore[attr-defined]  # for inspect.unwrap
    setattr(wrapper, _HOOK_MARK, True)
    return wrapper


def _is_plugin_hook(function: Any) -> bool:
    return getattr(function, _HOOK_MARK, False) is True


@contextlib.contextmanager
def _no_fairscale_wrapping(distributed_cfg: Any, **kwargs: Any) -> Iterator[None]:
    """Replaces ``fsdp_enable_wrap``, around fairseq's model build: build plain layers
    (sharding happens as each layer is built, and in the trainer), with random fills of
    layers already sharded drawn as an unsharded build draws them (``sharded_init``: BART
    initialises every weight again once its layers exist). (The nllb branch passes
    ``is_moe=``; MoE models are refused before this point.)"""
    if settings_of_training() is None:
        yield
        return
    from fairseq_shard_plugin.sharding.sharded_init import full_tensor_random_fills

    with full_tensor_random_fills():
        yield


def _leave_unwrapped(module: Any, **kwargs: Any) -> Any:
    """Replaces ``fsdp_wrap`` for the root model: no fairscale wrapper around it."""
    return module


def _sharding_layers_as_built(stock_wrap: Callable[..., Any]) -> Callable[..., Any]:
    """Replaces ``fsdp_wrap`` where the transformer layer builders call it (hook 1): in a
    sharded training the layer is sharded right away (``parallelize.shard_layer_as_built``),
    elsewhere fairseq's own (a no-op outside fairscale's wrapping context)."""
    def wrap_layer(module: Any, **kwargs: Any) -> Any:
        settings = settings_of_training()
        if settings is None:
            return stock_wrap(module, **kwargs)
        from fairseq_shard_plugin.sharding.parallelize import shard_layer_as_built

        return shard_layer_as_built(module, settings)

    return _marked(wrap_layer, stock_wrap)


# fairseq's modules whose layer builders call ``fsdp_wrap``: the first two exist in 0.12 and
# the nllb branch, the last only in some versions (where it exists, it is hooked too)
_LAYER_BUILDERS = ("fairseq.models.transformer.transformer_encoder",
                   "fairseq.models.transformer.transformer_decoder")
_OPTIONAL_LAYER_BUILDERS = ("fairseq.models.transformer.transformer_decoder_aug",)


def _layer_builder_modules() -> list[Any]:
    """The modules of ``_LAYER_BUILDERS`` and those of ``_OPTIONAL_LAYER_BUILDERS`` that
    this fairseq has (``_unhookable`` has checked that each has its ``fsdp_wrap``)."""
    modules = [importlib.import_module(name) for name in _LAYER_BUILDERS]
    for name in _OPTIONAL_LAYER_BUILDERS:
        with contextlib.suppress(ModuleNotFoundError):
            modules.append(importlib.import_module(name))
    return modules


def _select_trainer(stock_trainer: type) -> Callable[..., Any]:
    def make_trainer(cfg: Any, task: Any, model: Any, criterion: Any, quantizer: Any = None) -> Any:
        check_model = getattr(criterion, "refuse_unfit_model", None)  # the plugin's criterion
        if callable(check_model):  # (the first place where fairseq has both)
            check_model(model)
        if is_sharded_run(cfg):
            from fairseq_shard_plugin.training.trainer import ShardedTrainer

            return ShardedTrainer(cfg, task, model, criterion, quantizer)
        return with_private_loaded_state(stock_trainer)(cfg, task, model, criterion, quantizer)

    return make_trainer


def _checked_configuration(cfg: Any) -> bool:
    """Apply the launcher's variables and check the configuration before fairseq starts;
    whether the run is sharded (else the plugin's options without effect are named)."""
    apply_torchrun_environment(cfg)
    if not is_sharded_run(cfg):
        check_any_backend(cfg)
        unused = options_given(cfg.task)
        if unused and distributed_utils.is_master(cfg.distributed_training):  # not one a rank
            logger.warning(
                f"{', '.join(unused)}: the plugin's options take effect only with "
                f"--ddp-backend fully_sharded (this run: "
                f"{cfg.distributed_training.ddp_backend})")
        return False
    untie_bf16_from_tpu(cfg)
    allocator = default_allocator_setting(use_cuda=uses_cuda(cfg))
    if allocator and distributed_utils.is_master(cfg.distributed_training):
        logger.info(f"{allocator} (set by the plugin for sharded CUDA runs: less "
                    "memory reserved beyond the peak; set the variable to choose)")
    host = None if uses_cuda(cfg) else return_freed_blocks()
    if host and distributed_utils.is_master(cfg.distributed_training):
        logger.info(f"{host}: set by the plugin for CPU ranks, so that memory freed during a "
                    "step goes back to the system (set the variable to choose)")
    if take_use_sharded_state(cfg) and distributed_utils.is_master(cfg.distributed_training):
        logger.info("--use-sharded-state: checkpoints in the plugin's sharded format "
                    "(each rank writes its shards; checkpoint_last.pt indexes them)")
    check_sharded_config(cfg)
    check_batch_size(cfg)
    check_chunked_validation(cfg)
    check_a_lost_last_checkpoint(cfg.checkpoint)
    not_loaded = finetune_not_loaded(cfg.checkpoint)
    if not_loaded and distributed_utils.is_master(cfg.distributed_training):
        logger.warning(not_loaded)
    return True


def _error_line(error: ShardPluginError, cfg: Any) -> str:
    """The line that ends the run: under fairseq-hydra-train, flags named as its keys."""
    return f"fairseq-shard-plugin: error: {as_written(str(error), cfg)}"


def _with_launcher_environment(stock_call_main: Callable[..., Any]) -> Callable[..., Any]:
    def call_main(cfg: Any, main: Callable[..., Any], **kwargs: Any) -> Any:
        try:  # the configuration's checks: the same on every rank of a node (its files)
            sharded = _checked_configuration(cfg)
        except ShardPluginError as error:  # one line a node, not one a rank
            exit_with(_error_line(error, cfg), print_it=prints_here())
        try:  # the training's and the export's one-line errors
            return stock_call_main(cfg, TrainThenExport(main) if sharded else main, **kwargs)
        except ShardPluginError as error:
            exit_with(_error_line(error, cfg), print_it=prints_here(error.node_wide))
        except RuntimeError as error:  # a peer rank's process ended: its error says why
            line = peer_ended_line(error) if sharded else None
            if line is None:
                raise
            exit_with(line)

    return _marked(call_main, stock_call_main)


class _AtomicLocalCopies(PathManager):
    """fairseq's ``PathManager`` with crash-safe copies between local files (hook 5)."""

    @staticmethod
    def copy(src_path: str, dst_path: str, overwrite: bool = False) -> bool:
        if "://" in src_path or "://" in dst_path:  # remote storage: fairseq's own copy
            return PathManager.copy(src_path, dst_path, overwrite)
        copy_atomically(src_path, dst_path)
        return True


@contextlib.contextmanager
def _atomic_checkpoint_copies() -> Iterator[None]:
    stock = checkpoint_utils.PathManager
    checkpoint_utils.PathManager = _AtomicLocalCopies
    try:
        yield
    finally:
        checkpoint_utils.PathManager = stock


def _with_atomic_copies(stock_save: Callable[..., Any]) -> Callable[..., Any]:
    def save_checkpoint(cfg: Any, trainer: Any, epoch_itr: Any, val_loss: Any,
                        *args: Any, **kwargs: Any) -> Any:
        # (the nllb branch adds ``training_finished`` and ``async_callback_fn``)
        if not getattr(trainer, "writes_checkpoints_atomically", False):
            try:  # fairseq's own trainer (another --ddp-backend): its copies made atomic too
                with _atomic_checkpoint_copies():
                    return stock_save(cfg, trainer, epoch_itr, val_loss, *args, **kwargs)
            except WriteError as error:
                raise save_failure(error, cfg.save_dir) from error
        gathers_before = trainer.state_dict_calls
        saving_rank = trainer.should_save_checkpoint_on_current_rank
        trainer.written_whole = None
        failure: WriteError | None = None
        try:  # a refused write (full disk) ends the run in one line that says what to do
            with _atomic_checkpoint_copies():
                saved = stock_save(cfg, trainer, epoch_itr, val_loss, *args, **kwargs)
            if not cfg.no_save and trainer.state_dict_calls == gathers_before:
                # Building the state is collective (gathers, or a DCP save), so every rank
                # must build it once per save. fairseq 0.12 has the other ranks build it at
                # every save, even when the saving rank writes no file (a save on a signal
                # or at the last update with --no-last-checkpoints); the nllb branch has
                # them return first. Whichever rank did not build it during this save
                # builds it now (the saving rank's copy is then discarded).
                trainer.state_dict()
                if getattr(cfg, "synchronize_checkpoints_before_copy", False):
                    # the nllb branch's barrier, which it runs on ranks that wrote: already
                    # satisfied (the save above was collective, and only the saving rank
                    # copies), joined so that no rank waits in it alone
                    dist.barrier()
        except WriteError as error:
            failure = _naming_what_was_written(error, trainer.written_whole)
        # the saving rank alone writes the files: the others learn of its failure here,
        # and stop with the same line instead of a broken connection at the next step
        failed = first_failure(failure)
        if failed is not None:
            raise save_failure(failure or WriteError(failed), cfg.save_dir) from failure
        if saving_rank and not cfg.no_save:
            trainer.after_checkpoint_save()
        return saved

    # fairseq keeps the best validation loss as an attribute of the module-level function
    # (``save_checkpoint.best``), looked up by name: it now lives on this wrapper.
    return _marked(save_checkpoint, stock_save)


def _naming_what_was_written(error: WriteError, written: str | None) -> WriteError:
    """A failed copy of a save's first file to its other names (checkpoint_best.pt,
    checkpoint_last.pt) leaves that file whole, at a later update than checkpoint_last.pt:
    the error says so, and how to resume from it."""
    if not written or os.path.basename(written) in str(error):
        return error
    name = os.path.basename(written)
    if not os.path.isfile(os.path.join(os.path.dirname(written), "checkpoint_last.pt")):
        return WriteError(f"{error}; {name} was written whole before it, and no "
                          f"checkpoint_last.pt yet: to resume from {name}, copy it to "
                          "checkpoint_last.pt first")
    return WriteError(f"{error}; {name} was written whole before it: to resume from its "
                      "update rather than checkpoint_last.pt's, copy it over "
                      "checkpoint_last.pt first")


def _full_tensors_of_index(path: str, index: dict[str, Any]) -> dict[str, Any]:
    from fairseq_shard_plugin.checkpoint.sharded import SHARDED_KEY, fill_tensors, full_tensors

    skeleton = {key: value for key, value in index.items() if key != SHARDED_KEY}
    return fill_tensors(skeleton, full_tensors(path, index))


class _TorchMappingCheckpoints(types.ModuleType):
    """``torch`` as fairseq 0.12's ``load_checkpoint_to_cpu`` sees it under hook 6: its
    ``torch.load(f, map_location=...)`` of an open local file maps that file
    (:func:`~.checkpoint.reading.read_checkpoint`); every other name is torch's."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)

    @staticmethod
    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        path = getattr(f, "name", None)
        if isinstance(path, str) and os.path.isfile(path) and not args \
                and set(kwargs) <= {"map_location"}:
            return with_model_namespace(read_checkpoint(path, kwargs.get("map_location", "cpu")))
        return with_model_namespace(torch.load(f, *args, **kwargs))


@contextlib.contextmanager
def _checkpoints_mapped() -> Iterator[None]:
    """While active, fairseq's ``checkpoint_utils`` maps the checkpoints it loads."""
    import torch

    if checkpoint_utils.__dict__.get("torch") is not torch:  # nested, or not fairseq's
        yield
        return
    checkpoint_utils.torch = _TorchMappingCheckpoints()
    try:
        yield
    finally:
        checkpoint_utils.torch = torch


def _refuse_a_damaged_file(path: str) -> None:
    """A full checkpoint read outside the sharded trainer (generation, from_pretrained,
    another backend) is CRC-checked as the trainer checks it: a changed byte translated
    differently without a word, and a truncated file ended in torch's traceback."""
    from pathlib import Path

    from fairseq_shard_plugin.checkpoint.integrity import (
        corruption_message,
        damaged_zip_entries,
        is_truncated_zip,
    )

    local = Path(path)
    if "://" in path or not local.is_file():
        return
    again = "use an intact copy (fairseq-shard-verify FILE or SAVE_DIR checks them)"
    if is_truncated_zip(local):
        raise CheckpointLoadError(f"{path}: truncated checkpoint ({local.stat().st_size} bytes: "
                                  f"its end, the zip directory, is missing); {again}")
    damaged = damaged_zip_entries(local)
    if damaged:
        raise CheckpointLoadError(corruption_message(path, damaged, again))


def _what_was_read(path: str, state: Any, languages: list[str] | None) -> CheckpointRead:
    """What the task checks of the checkpoint ``state`` read from ``path``: its shapes, its
    language-token options and the language list its tokens were numbered by
    (``languages_numbering_the_tokens``, taken before a stored file path was read)."""
    model = state.get("model") if isinstance(state, dict) else None
    shapes = tensor_shapes(model) if isinstance(model, dict) else {}
    return CheckpointRead(str(path), languages, shapes, stored_language_tokens(state))


def _with_sharded_checkpoints(stock_load: Callable[..., Any]) -> Callable[..., Any]:
    def load_checkpoint_to_cpu(path: str, arg_overrides: Any = None,
                               load_on_all_ranks: bool = False, **kwargs: Any) -> Any:
        from fairseq_shard_plugin.checkpoint.fairscale_sets import (
            is_rank_file_state,
            read_rank_file,
        )
        from fairseq_shard_plugin.checkpoint.fairscale_shards import (
            consolidated_state,
            modules_shared_by_config,
        )
        from fairseq_shard_plugin.checkpoint.sharded import is_sharded_index

        if active_trainer_loader() is None:  # the sharded trainer checks on all ranks
            _refuse_a_damaged_file(path)
        try:
            with _checkpoints_mapped():
                state = stock_load(path, arg_overrides, load_on_all_ranks,
                                   **kwargs)  # nllb: is_moe
        except (NotACheckpointError, pickle.UnpicklingError) as error:
            if active_trainer_loader() is not None:
                raise  # the sharded trainer names it with the model's shapes at hand
            raise CheckpointLoadError(describe_unreadable(path, error)) from error
        numbered_by = languages_numbering_the_tokens(state)  # (not a path read now)
        loader = active_trainer_loader()
        # a --langs path, as earlier versions saved it (said where it stays one, except to
        # the plugin's trainer: a resume saves its own run's list)
        state = languages_as_lists(state, path, warn=loader is None)
        if loader is not None:
            note_checkpoint_read(_what_was_read(path, state, numbered_by))
            return loader(path, state)
        if is_rank_file_state(state):  # stock fully_sharded's per-rank files: the whole set
            state = consolidated_state(path, state, read_rank_file, None, None,
                                       modules_shared_by_config(state))
        elif is_sharded_index(state):
            try:
                state = _full_tensors_of_index(path, state)
            except ShardPluginError as error:  # its advice to resume, where nothing trains
                if stock_trainer_optimizer() is not None:
                    raise
                raise CheckpointLoadError(str(error).replace(RESUME_HINT, (
                    "use an intact checkpoint (fairseq-shard-verify FILE or SAVE_DIR checks "
                    "them)"))) from error
        # the task checks the model next
        note_checkpoint_read(_what_was_read(path, state, numbered_by))
        optimizer = stock_trainer_optimizer()
        if optimizer is not None and isinstance(state, dict):  # fairseq's own trainer
            give_to_stock_optimizer(path, state, *optimizer())
        return state

    return _marked(load_checkpoint_to_cpu, stock_load)


def _keeping_fp32_masters(stock_load_cpu: Callable[..., Any]) -> Callable[..., Any]:
    """Replaces the nllb branch's ``torch_load_cpu`` in ``checkpoint_utils`` (hook 7)."""

    def torch_load_cpu(path: str) -> Any:
        from fairseq_shard_plugin.checkpoint.sharded import is_sharded_index

        state = with_model_namespace(read_checkpoint(path))
        if active_trainer_loader() or not isinstance(state, dict) or is_sharded_index(state):
            return state  # fp32 masters for the trainer; shard references stay references
        common = (state.get("cfg") or {}).get("common") or {}
        if common.get("fp16") or common.get("memory_efficient_fp16"):  # the branch's own rule
            state["model"] = {name: value.half() for name, value in state["model"].items()}
        return state

    return _marked(torch_load_cpu, stock_load_cpu)


def _importing_the_plugin_once(stock_import: Callable[..., Any]) -> Callable[..., Any]:
    """Replaces ``fairseq.utils.import_user_module`` (hook 8)."""

    def import_user_module(args: Any) -> Any:
        user_dir = getattr(args, "user_dir", None)
        if user_dir and names_this_plugin(user_dir):
            _name_another_copy(user_dir)
            return None  # imported already: this module is part of it
        return stock_import(args)

    return _marked(import_user_module, stock_import)


def _name_another_copy(user_dir: str) -> None:
    """A ``--user-dir`` (``common.user_dir``) of this plugin's name that is another copy
    than the one already loaded (by the Hydra callback, or installed) is skipped, as
    fairseq skips a module name imported before: said once, since a patched checkout does
    not run. (Not refused: a non-editable install and the checkout it came from are two
    copies too.)"""
    loaded = os.path.dirname(os.path.abspath(__file__))
    fairseq_dir = os.path.dirname(os.path.abspath(fairseq_utils.__file__))
    # where fairseq's import_user_module looks: the path, then beside fairseq's package
    found = next((path for path in (os.path.abspath(user_dir),
                                    os.path.join(fairseq_dir, user_dir),
                                    os.path.join(fairseq_dir, "..", user_dir))
                  if os.path.exists(path)), None)
    if found is not None and not os.path.samefile(found, loaded):  # (a name found nowhere
        # is the configs' relative default, run from elsewhere: the loaded copy is meant)
        warn_once(f"--user-dir {user_dir} (common.user_dir) is another copy of the plugin: "
                  "the plugin already loaded (installed, or imported by the Hydra callback) "
                  f"runs, from {loaded}")


def _verifying_on_rank_zero(stock_verify: Callable[..., Any]) -> Callable[..., Any]:
    def verify_checkpoint_directory(save_dir: str, *args: Any, **kwargs: Any) -> Any:
        if launcher_rank() not in (None, 0):  # hook 12: rank 0 probes the save dir
            return None
        try:
            return stock_verify(save_dir, *args, **kwargs)
        except OSError as error:  # fairseq logs it, then re-raises it as a traceback
            raise WriteError(f"cannot write to the save dir {save_dir}: "
                             f"{describe_os_error(error)}; give a --save-dir that can be "
                             "written") from error

    return _marked(verify_checkpoint_directory, stock_verify)


def _short_parser_errors(stock_error: Callable[..., Any]) -> Callable[..., Any]:
    """Replaces ``argparse.ArgumentParser.error`` (hook 11)."""

    def error(parser: argparse.ArgumentParser, message: str) -> Any:
        options = getattr(parser, "_option_string_actions", {})
        if "--user-dir" not in options or not parser.prog.startswith("fairseq-"):
            return stock_error(parser, message)  # not a fairseq command's parser
        message, _, listed = message.partition(" (choose from ")
        if listed:  # an invalid choice: the closest of the choices, else all of them
            given = re.findall(r"invalid choice: '([^']*)'", message)
            wrong, candidates = (given or [""])[0], re.findall(r"'([^']*)'", listed)
        else:
            wrong = " ".join(re.findall(r"(?<!\S)(--?[\w-]+)",
                                        message.partition("arguments:")[2]))
            candidates = list(options)
        hints = [f"did you mean {close[0]}?" for word in wrong.split()
                 if (close := difflib.get_close_matches(word, candidates, n=1, cutoff=0.8))]
        if not hints and not listed:  # the plugin's own options under another task
            hints = [f"{word} is an option of --task sharded_translation and "
                     "sharded_translation_multi_simple_epoch" for word in wrong.split()
                     if word in SHARDING_FLAGS] + [
                     f"{word} is an option of --criterion {CHUNKED_CRITERION}"
                     for word in wrong.split() if word in CHUNKED_CRITERION_FLAGS]
        if hints:
            hint = f" ({'; '.join(hints)})"
        elif listed:  # argparse's own list: fairseq's --help lists no choice
            hint = f" (choose from {listed}"
        else:
            hint = ""
        line = f"{parser.prog}: error: {message}{hint}"
        tell_the_launcher(line)
        if launcher_rank() in (None, 0):  # one line from rank 0, under torchrun or srun
            parser.exit(2, f"{line}\n")
        parser.exit(2)

    return _marked(error, stock_error)


def _saving_on_signal(stock_validate_and_save: Callable[..., Any]) -> Callable[..., Any]:
    def validate_and_save(cfg: Any, trainer: Any, task: Any, epoch_itr: Any,
                          valid_subsets: Any, end_of_epoch: bool, *args: Any,
                          **kwargs: Any) -> Any:
        stop = getattr(trainer, "signal_stop", None)  # only the plugin's trainer has one
        signum = stop.agreed(trainer.device) if stop is not None else None
        update = trainer.get_num_updates()
        last_epoch = end_of_epoch and epoch_itr.epoch >= (cfg.optimization.max_epoch
                                                          or float("inf"))
        if signum is not None and (
                update >= (cfg.optimization.max_update or float("inf")) or last_epoch):
            # the signal came during the last update: fairseq's own end follows (its
            # validation, a final save, exit code 0); a resume would otherwise train one
            # update past the end, or (--max-epoch) never validate the last epoch
            stop.stopped_by = None
            signum = None
        if signum is not None and end_of_epoch:  # the epoch's validation (its best
            # checkpoint) is due now and a resume starts the next epoch: validate, then stop
            valid_losses, _ = stock_validate_and_save(
                cfg, trainer, task, epoch_itr, valid_subsets, end_of_epoch, *args, **kwargs)
            if trainer.saved_at_update != update or cfg.checkpoint.no_last_checkpoints:
                _save_on_signal(cfg, trainer, epoch_itr, signum, update)
            else:  # the epoch's own save was the signal's
                logger.info(f"{signal.Signals(signum).name}: stopping after update {update}, "
                            f"the end of epoch {epoch_itr.epoch}, validated and saved "
                            f"(exit code {128 + signum}); {_how_to_resume(cfg.checkpoint)}")
            return valid_losses, True
        if signum is None:
            valid_losses, should_stop = stock_validate_and_save(
                cfg, trainer, task, epoch_itr, valid_subsets, end_of_epoch, *args, **kwargs)
            if ends_without_a_save(cfg, trainer, epoch_itr, end_of_epoch, should_stop):
                logger.info(f"saving the final model (update {update}) for "
                            "--export-consolidated: fairseq's --save-interval skipped it")
                checkpoint_utils.save_checkpoint(cfg.checkpoint, trainer, epoch_itr, None)
            return valid_losses, should_stop
        _save_on_signal(cfg, trainer, epoch_itr, signum, update)
        return [None], True

    return _marked(validate_and_save, stock_validate_and_save)


def _save_on_signal(cfg: Any, trainer: Any, epoch_itr: Any, signum: int, update: int) -> None:
    """The save a stop on ``signum`` makes (checkpoint_last.pt; none under --no-save)."""
    name = signal.Signals(signum).name
    if cfg.checkpoint.no_save:
        logger.warning(as_written(f"{name}: stopping after update {update}, not saving "
                                  "(--no-save)", cfg))
        return
    logger.info(as_written(f"{name}: saving a checkpoint after update {update}, then "
                           f"stopping (exit code {128 + signum}); "
                           f"{_how_to_resume(cfg.checkpoint)}", cfg))
    checkpoint_utils.save_checkpoint(config_for_a_signal_save(cfg.checkpoint),
                                     trainer, epoch_itr, None)


def _how_to_resume(checkpoint_cfg: Any) -> str:
    """How to continue from the save a signal made: fairseq loads --restore-file (the save
    dir's checkpoint_last.pt unless named) with the --reset-* flags at every launch, so the
    same command resumes only where that is the file just saved and no flag resets."""
    suffix = checkpoint_cfg.checkpoint_suffix or ""
    last = os.path.join(checkpoint_cfg.save_dir, f"checkpoint_last{suffix}.pt")
    restore = checkpoint_cfg.restore_file
    loads = last if restore == "checkpoint_last.pt" else restore.replace(".pt", f"{suffix}.pt")
    other_file = os.path.realpath(loads) != os.path.realpath(last)  # (links resolved)
    resets = reset_flags_given(checkpoint_cfg)
    if not other_file and not resets:
        return "the same command resumes from it"
    drop = " and ".join(([f"--restore-file {restore}"] if other_file else [])
                        + ([" ".join(resets)] if resets else []))
    return (f"resume from it with the same command without {drop} (each launch would start "
            "from that file or those resets again; --finetune-from-model starts from a file "
            "only once)")


def _checking_the_languages(stock_build: Callable[..., Any]) -> Callable[..., Any]:
    """Replaces ``TranslationMultiSimpleEpochTask.build_model`` (hook 13)."""
    from fairseq_shard_plugin.tasks.sharded_multilingual import (
        ShardedTranslationMultiSimpleEpochTask,
        check_the_checkpoints_languages,
    )

    def build_model(self: Any, cfg: Any, from_checkpoint: bool = False, *args: Any,
                    **kwargs: Any) -> Any:
        if from_checkpoint and not isinstance(self, ShardedTranslationMultiSimpleEpochTask):
            check_the_checkpoints_languages(self, cfg)  # the plugin's task checks its own
        return stock_build(self, cfg, from_checkpoint, *args, **kwargs)

    return _marked(build_model, stock_build)


def _naming_a_langs_file(stock_setup: Callable[..., Any]) -> Callable[..., Any]:
    """Replaces ``TranslationMultiSimpleEpochTask.setup_task``'s function (hook 13)."""
    from fairseq_shard_plugin.tasks.multilingual_config import MultilingualOptionError

    def setup_task(cls: type, args: Any, *more: Any, **kwargs: Any) -> Any:
        try:
            return stock_setup(cls, args, *more, **kwargs)
        except ValueError as error:
            langs = getattr(args, "langs", None)
            if not (isinstance(langs, list) and len(langs) == 1 and os.path.isfile(
                    str(langs[0])) and "not in the language dictionary" in str(error)):
                raise
            raise MultilingualOptionError(
                f"--langs {langs[0]}: fairseq's translation_multi_simple_epoch reads --langs "
                "as comma-separated codes, not a file: give --lang-dict "
                f"{langs[0]}, the codes themselves, or --task "
                "sharded_translation_multi_simple_epoch, which reads either") from None

    return _marked(setup_task, stock_setup)


def _train_modules() -> list[Any]:
    """``fairseq_cli.train``, and ``__main__`` when run as ``python -m fairseq_cli.train``."""
    modules = [train_cli]
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", "")
    if main is not None and spec_name == train_cli.__name__:
        modules.append(main)
    return modules


# fairseq's multilingual task, whose build_model and setup_task hook 13 wraps
_MULTILINGUAL_TASK = ("fairseq.tasks.translation_multi_simple_epoch",
                      "TranslationMultiSimpleEpochTask")


def _multilingual_task() -> type:
    module, name = _MULTILINGUAL_TASK
    return getattr(importlib.import_module(module), name)


def _unhookable() -> list[str]:
    """The names install() replaces, swaps or overrides that this fairseq lacks or has as
    something else: each would otherwise leave its hook silently without effect. Each is
    looked up part by part, so that a missing one is named, not met as an AttributeError."""
    checkpoints = "fairseq.checkpoint_utils"
    multilingual = _MULTILINGUAL_TASK
    required = [("fairseq_cli.train", name) for name in _HOOKED_NAMES] + [
        ("fairseq.distributed.utils", "call_main"),
        (checkpoints, "load_checkpoint_to_cpu"),
        (checkpoints, "save_checkpoint"),
        (checkpoints, "verify_checkpoint_directory"),
        ("fairseq.utils", "import_user_module"),
        (checkpoints, "PathManager.copy"),  # hook 5 swaps the module's PathManager
        # the private methods ShardedTrainer overrides (hook 2)
        ("fairseq.trainer", "Trainer._build_optimizer"),
        ("fairseq.trainer", "Trainer._reduce_and_log_stats"),
        (multilingual[0], f"{multilingual[1]}.build_model"),  # hook 13
        (multilingual[0], f"{multilingual[1]}.setup_task"),
    ]
    if hasattr(checkpoint_utils, "torch_load_cpu"):  # nllb branch only
        required.append((checkpoints, "torch_load_cpu"))
    unhookable = []
    for name in _LAYER_BUILDERS + _OPTIONAL_LAYER_BUILDERS:  # hook 1, as fairseq builds
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            if name in _LAYER_BUILDERS:
                unhookable.append(f"missing {name}")
        else:
            required.append((name, "fsdp_wrap"))
    unhookable += filter(None, (_missing_or_not_callable(*names) for names in required))
    import torch

    if checkpoint_utils.__dict__.get("torch") is not torch:  # hook 6 swaps it while loading
        unhookable.append("fairseq.checkpoint_utils does not use torch under that name")
    return unhookable


def _missing_or_not_callable(module: str, attributes: str) -> str | None:
    """What is wrong with the callable ``module``.``attributes`` (dotted, as in
    ``Trainer._build_optimizer``): the first part missing, or the last not callable; or None."""
    try:
        value: Any = importlib.import_module(module)
    except ImportError:
        return f"missing {module}"
    shown = module
    for part in attributes.split("."):
        shown += f".{part}"
        value = getattr(value, part, None)
        if value is None:
            return f"missing {shown}"
    return None if callable(value) else f"{shown} is not callable"


class UnsupportedFairseqError(ShardPluginError, ImportError):
    """A fairseq without the names the plugin hooks; one line naming its version."""


# fairseq's model modules that ``eval`` layer specs from the model config (hook 10)
_SPEC_EVALUATING_MODULES = ("fairseq.models.fconv", "fairseq.models.fconv_lm",
                            "fairseq.models.fconv_self_att", "fairseq.models.lightconv_lm",
                            "fairseq.models.transformer_lm")


def _literal_specs_only() -> None:
    """Hook 10: the spec-evaluating modules find the plugin's ``eval`` before the builtin."""
    from fairseq_shard_plugin.checkpoint.literal_specs import literal_spec

    for name in _SPEC_EVALUATING_MODULES:
        with contextlib.suppress(ModuleNotFoundError):
            importlib.import_module(name).eval = literal_spec


def install() -> None:
    """Install the hooks once; fail clearly on a fairseq without the expected names."""
    unhookable = _unhookable()
    if unhookable:
        raise UnsupportedFairseqError(
            f"fairseq_shard_plugin does not support fairseq {fairseq.__version__}: "
            f"{', '.join(unhookable)} (supported: fairseq 0.12.x and its nllb branch)"
        )
    for module in _train_modules():
        if getattr(module, _INSTALLED_MARK, False):
            continue
        module.fsdp_enable_wrap = _no_fairscale_wrapping
        module.fsdp_wrap = _leave_unwrapped
        module.Trainer = _select_trainer(module.Trainer)
        module.validate_and_save = _saving_on_signal(module.validate_and_save)
        setattr(module, _INSTALLED_MARK, True)
    for module in _layer_builder_modules():
        if not _is_plugin_hook(module.fsdp_wrap):
            module.fsdp_wrap = _sharding_layers_as_built(module.fsdp_wrap)
    fairseq_meters.MaxMeter = MaxMeter
    _literal_specs_only()
    stock_load_cpu = getattr(checkpoint_utils, "torch_load_cpu", None)  # nllb branch only
    if stock_load_cpu is not None and not _is_plugin_hook(stock_load_cpu):
        checkpoint_utils.torch_load_cpu = _keeping_fp32_masters(stock_load_cpu)
    if not _is_plugin_hook(fairseq_utils.import_user_module):
        fairseq_utils.import_user_module = _importing_the_plugin_once(
            fairseq_utils.import_user_module)
    if not _is_plugin_hook(checkpoint_utils.load_checkpoint_to_cpu):
        checkpoint_utils.load_checkpoint_to_cpu = _with_sharded_checkpoints(
            checkpoint_utils.load_checkpoint_to_cpu)
    if not _is_plugin_hook(checkpoint_utils.save_checkpoint):
        checkpoint_utils.save_checkpoint = _with_atomic_copies(checkpoint_utils.save_checkpoint)
    if not _is_plugin_hook(checkpoint_utils.verify_checkpoint_directory):
        checkpoint_utils.verify_checkpoint_directory = _verifying_on_rank_zero(
            checkpoint_utils.verify_checkpoint_directory)
    if not _is_plugin_hook(distributed_utils.call_main):
        distributed_utils.call_main = _with_launcher_environment(distributed_utils.call_main)
    multilingual = _multilingual_task()
    if not _is_plugin_hook(multilingual.build_model):
        multilingual.build_model = _checking_the_languages(multilingual.build_model)
    if not _is_plugin_hook(multilingual.setup_task.__func__):
        multilingual.setup_task = classmethod(  # type: ignore[method-assign]
            _naming_a_langs_file(multilingual.setup_task.__func__))
    if not _is_plugin_hook(argparse.ArgumentParser.error):
        argparse.ArgumentParser.error = _short_parser_errors(  # type: ignore[method-assign]
            argparse.ArgumentParser.error)
