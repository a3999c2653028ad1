"""``ShardedTrainer``: fairseq's Trainer with the plugin's sharding instead of fairscale's.

fairseq's Trainer guards its fairscale-specific code with ``is_fsdp``; this subclass turns
those branches off and overrides the few methods they served, so the rest of fairseq's
training loop (batching, logging, validation, checkpoint scheduling) runs unchanged.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Callable, Iterator
from itertools import chain
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fairseq.logging import metrics
from fairseq.optim import lr_scheduler
from fairseq.trainer import Trainer
from omegaconf import OmegaConf
from torch.distributed.tensor.experimental import implicit_replication

from fairseq_shard_plugin.checkpoint.errors import (
    CheckpointLoadError,
    describe_checkpoint_problem,
    describe_schedule_problem,
    first_cause,
    for_a_fine_tune,
    in_save_dir,
    keeping_the_save_dir,
    state_dict_shapes,
)
from fairseq_shard_plugin.checkpoint.fairscale_sets import first_rank_file
from fairseq_shard_plugin.checkpoint.portable import languages_as_lists, with_plain_config
from fairseq_shard_plugin.checkpoint.sharded import shard_directory
from fairseq_shard_plugin.checkpoint.space import (
    full_state_bytes,
    space_report,
    structure_bytes,
)
from fairseq_shard_plugin.errors import ShardPluginError
from fairseq_shard_plugin.hydra_keys import as_written
from fairseq_shard_plugin.memory.meters import (
    StepMemoryProbe,
    peak_rss_bytes,
    storage_bytes,
    watch_offloaded_state,
)
from fairseq_shard_plugin.memory.metrics import log_step_memory
from fairseq_shard_plugin.memory.model import GIB
from fairseq_shard_plugin.memory.run_estimate import (
    describe_run,
    host_memory_warning,
    log_predicted_peak,
    out_of_memory_clause,
)
from fairseq_shard_plugin.run_hooks import export_follows_training, loading_into_trainer
from fairseq_shard_plugin.sharding.full_state import loading_full_tensors_into_shards
from fairseq_shard_plugin.sharding.gradients import maxima_reducer
from fairseq_shard_plugin.sharding.host_step_overlap import BackgroundHostStep, owning_units
from fairseq_shard_plugin.sharding.native_adam import SWITCH, native_library
from fairseq_shard_plugin.sharding.optimizer import build_sharded_optimizer
from fairseq_shard_plugin.sharding.options import checkpoint_format, sharding_options
from fairseq_shard_plugin.sharding.parallelize import parallelize
from fairseq_shard_plugin.sharding.settings import ShardingSettings, warn_once
from fairseq_shard_plugin.sharding.sharded_adam import ShardedAdam
from fairseq_shard_plugin.training import signal_stop
from fairseq_shard_plugin.training.cpu_rank_hints import cpu_rank_hints
from fairseq_shard_plugin.training.data_position import convert_position, record_ranks
from fairseq_shard_plugin.training.divergence import diverged
from fairseq_shard_plugin.training.final_saves import refuse_a_step_past_the_end
from fairseq_shard_plugin.training.launch_env import (
    ensure_process_group,
    host_threads_per_rank,
    uses_cuda,
)
from fairseq_shard_plugin.training.out_of_memory import stop_on_out_of_memory
from fairseq_shard_plugin.training.private_state import release_checkpoint_pages
from fairseq_shard_plugin.training.trainer_files import (
    after_save,
    checkpoint_state,
    read_sharded_index,
    save_full_checkpoint,
    trainer_state_loader,
    verify_full_checkpoint,
)
from fairseq_shard_plugin.training.validation import (
    ShardingConfigError,
    check_sharded_config,
    generating_validation_option,
    ignored_fsdp_flags,
)
from fairseq_shard_plugin.training.worker_temp_dir import share_temp_dir_with_data_workers

logger = logging.getLogger(__name__)


_SIXTEEN_BIT_FLAGS = ("fp16", "bf16", "memory_efficient_fp16", "memory_efficient_bf16")


@contextlib.contextmanager
def _without_16_bit_flags(common_cfg: Any) -> Iterator[None]:
    """Hide the 16-bit flags from fairseq's Trainer constructor, which would cast the whole
    model to 16 bits; here parameters stay fp32 masters and FSDP casts gathered copies."""
    saved = {flag: common_cfg[flag] for flag in _SIXTEEN_BIT_FLAGS}
    for flag in _SIXTEEN_BIT_FLAGS:
        common_cfg[flag] = False
    try:
        yield
    finally:
        for flag, value in saved.items():
            common_cfg[flag] = value


@contextlib.contextmanager
def _offload_hidden(trainer: Any, dist_cfg: Any) -> Iterator[None]:
    """Under ``--cpu-offload``, keep fairseq's Trainer constructor from refusing the flag
    (it requires its own fairscale path) and from moving the model to the device: FSDP has
    placed it already, with the shards on CPU, and ``.to(device)`` would move them back."""
    offload = bool(dist_cfg.cpu_offload)
    dist_cfg.cpu_offload = False
    trainer._placed_by_fsdp = offload
    try:
        yield
    finally:
        dist_cfg.cpu_offload = offload
        trainer._placed_by_fsdp = False


def _log_flags_taken_over(cfg: Any, settings: ShardingSettings) -> None:
    """Name fairseq's FSDP flags the plugin does not use, the plugin's own options that have
    no effect in this run, what ZeRO-2 costs, and the checkpoint format chosen for
    offloaded runs."""
    for flag in ignored_fsdp_flags(cfg):
        logger.info(f"ignored under the plugin: {flag}")
    options = sharding_options(cfg.task)
    if settings.compute_dtype is None:
        for flag in ("reduce_in_16_bit", "reduce_vocabulary_in_16_bit"):
            if getattr(options, flag):
                warn_once(f"--{flag.replace('_', '-')} has no effect in an fp32 run (its "
                          "gradients are fp32): add --fp16 or --bf16, or remove it")
    if options.shard_group_size and options.shard_strategy != "hybrid":
        warn_once(f"--shard-group-size {options.shard_group_size} has no effect without "
                  "--shard-strategy hybrid: this run shards fully over all its ranks")
    if options.layers_per_unit > 1 and options.root_unit_only:
        warn_once(f"--layers-per-unit {options.layers_per_unit} has no effect with "
                  "--root-unit-only (there are no layer units): remove one of them")
    for flag in ("keep_vocabulary_gathered", "reduce_vocabulary_in_16_bit"):
        if getattr(options, flag) and options.root_unit_only:
            warn_once(f"--{flag.replace('_', '-')} has no effect with --root-unit-only (there "
                      "is no vocabulary unit: the root holds the vocabulary): remove one of "
                      "them")
    if options.no_host_step_overlap and not settings.offload:
        warn_once("--no-host-step-overlap has no effect without --cpu-offload (the optimizer "
                  "steps on the device): remove it")
    if not settings.reshard.layers:
        logger.info("--no-reshard-after-forward: every unit stays gathered from its forward "
                    "to its backward (no all-gathers in backward; the whole model's "
                    "gathered copy is live at the peak)")
    if options.checkpoint_format == "auto" and checkpoint_format(cfg) == "sharded":
        logger.info("--cpu-offload: checkpoints are saved in the sharded format (each rank "
                    "writes its own shards; a full save would gather the whole model and "
                    "optimizer state in rank 0's host memory); --checkpoint-format full "
                    "for single files, fairseq-shard-consolidate for one afterwards")


def _among_the_save_dirs_indexes(filename: str, save_dir: str) -> bool:
    """Whether the shard cleanups read ``filename`` as an index of ``save_dir`` (a file of
    it, not hidden): else the shards a run was restored from would go at its first
    cleanup (an index outside, its checkpoint_shards linked to the save dir's)."""
    return in_save_dir(filename, save_dir) and not os.path.basename(filename).startswith(".")


def shard_groups(world_size: int, group_size: int) -> str:
    """``N ranks``, or for hybrid sharding the groups that each hold one sharded copy."""
    if group_size >= world_size:
        return f"{world_size} ranks"
    return (f"{world_size} ranks as {world_size // group_size} groups of {group_size} "
            "(hybrid: each group holds one sharded copy)")


class ShardedTrainer(Trainer):
    """Trainer for ``--ddp-backend fully_sharded`` with the plugin loaded."""

    def __init__(self, cfg: Any, task: Any, model: Any, criterion: Any,
                 quantizer: Any = None) -> None:
        check_sharded_config(cfg)
        self.sharding_options = sharding_options(cfg.task)
        if self.sharding_options.export_consolidated and not export_follows_training():
            raise ShardingConfigError(
                "task.export_consolidated: fairseq-hydra-train loaded the plugin too late to "
                "export after training: add the plugin's Hydra callback to the config (hydra."
                "callbacks, as configs/nllb/*.yaml do) or run fairseq-shard-consolidate later"
            )
        use_cuda = uses_cuda(cfg)
        ensure_process_group(cfg, use_cuda)
        self.settings = ShardingSettings.from_config(cfg, dist.get_world_size(), use_cuda)
        _log_flags_taken_over(cfg, self.settings)
        # the run as fairseq-shard-estimate flags, read from the model before it is sharded
        self._run_description = describe_run(cfg, model, self.shard_group_size)
        sharded = parallelize(model, self.settings)
        self.sharding_plan, self.engine = sharded.plan, sharded.engine
        # hooks on every unit's forward, in place before the first forward records the order
        self.host_step = (
            BackgroundHostStep([unit.modules for unit in (*sharded.plan.units,
                                                          sharded.plan.root)])
            if self.offload and self.settings.host_step_overlap
            and self.settings.engine == "fsdp2" else None)
        logger.info("sharded over %s with %s: %s; compute in %s, %s; host peak RSS of the "
                    "build %.3f GiB (VmHWM)",
                    shard_groups(dist.get_world_size(), self.shard_group_size),
                    self.settings.engine, sharded.description,
                    self.compute_dtype or torch.float32,
                    "16-bit parameter shards" if self.settings.sixteen_bit_parameters
                    else "fp32 master shards", peak_rss_bytes() / GIB)
        for hint in cpu_rank_hints(self.settings, use_cuda) if dist.get_rank() == 0 else ():
            logger.warning(as_written(hint, cfg))  # the same on every rank: said once
        if self.offload and use_cuda:
            # torchrun sets OMP_NUM_THREADS=1; the offloaded optimizer step runs on the host
            threads = host_threads_per_rank()
            torch.set_num_threads(threads)
            logger.info(f"--cpu-offload: the host's optimizer step uses {threads} threads "
                        "per rank")
        self._construct_fairseq_trainer(cfg, task, sharded.module, criterion, quantizer)
        self._memory_probe = (
            None if self.sharding_options.no_memory_report else StepMemoryProbe(self.device)
        )
        if self.offload and self._memory_probe is not None and self.device.type == "cpu":
            watch_offloaded_state(lambda: self._memory_probe, self._model.parameters())
        self._space_reported = False  # see _report_checkpoint_space
        self._orphans_removed = False  # see _remove_orphaned_shards
        self.loaded_shards: Path | None = None  # shards restored from an index elsewhere
        if self.is_data_parallel_master:
            prediction = log_predicted_peak(self._run_description, self.device, task,
                                            cfg.dataset.valid_subset)
            too_much_host_memory = host_memory_warning(
                prediction.host_peak_bytes if prediction is not None else None)
            if too_much_host_memory:
                logger.warning(too_much_host_memory)
        # read after every update by integration hook 9 (save and stop on a signal)
        self.signal_stop = signal_stop.install(
            signal_stop.parse_signals(self.sharding_options.save_on_signal))
        share_temp_dir_with_data_workers()
        self.saved_at_update: int | None = None  # the update of this run's last save
        self.written_whole: str | None = None  # the current save's first file, once written

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return self.settings.compute_dtype

    @property
    def shard_group_size(self) -> int:
        return self.settings.shard_group_size

    @property
    def offload(self) -> bool:
        return self.settings.offload

    def _construct_fairseq_trainer(self, cfg: Any, task: Any, sharded_model: Any,
                                   criterion: Any, quantizer: Any) -> None:
        """fairseq's own Trainer constructor, with what it must not do kept from it."""
        # Every rank reads the consolidated checkpoint itself and keeps its own slice;
        # fairseq's rank-0 broadcast would re-pickle the OmegaConf config, which
        # weights_only loading (rightly) refuses on the receiving ranks.
        cfg.checkpoint.load_checkpoint_on_all_dp_ranks = True
        with _without_16_bit_flags(cfg.common), _offload_hidden(self, cfg.distributed_training):
            super().__init__(cfg, task, sharded_model, criterion, quantizer)
        # the nllb branch's multilingual data manager expands the task's valid_subset into
        # one split per direction, which its train.py reads only for the stock task name
        task_valid_subset = getattr(getattr(task, "args", None), "valid_subset", None)
        if task_valid_subset and task_valid_subset != cfg.dataset.valid_subset:
            cfg.dataset.valid_subset = task_valid_subset
        # fairseq's train_step reads and resets CUDA's peak statistics for its gb_free metric
        # before returning, which would cut the step's peak the probe reads afterwards: its
        # CUDA environment is kept here instead, and gb_free comes from the probe's peak.
        self._cuda_environment, self.cuda_env = self.cuda_env, None
        if self.offload:  # fairseq's constructor left placement to FSDP (see _offload_hidden)
            self._criterion = self._criterion.to(device=self.device)

    # fairseq's is_fsdp branches call fairscale-only APIs (flat-parameter optimizer state,
    # DistributedFairseqModel's fairscale assertion, .cuda() in norm aggregation); each
    # thing they did is done by the overrides below instead.
    @property
    def is_fsdp(self) -> bool:
        return False

    @property
    def use_distributed_wrapper(self) -> bool:
        # FSDP reduce-scatters gradients in backward: no DDP-style wrapper around the model.
        # True only inside fairseq's constructor under --cpu-offload (see _offload_hidden).
        return getattr(self, "_placed_by_fsdp", False)

    # Read by integration hook 5: fairseq's copies to checkpoint_last/best become atomic.
    writes_checkpoints_atomically = True

    @property
    def always_call_state_dict_during_save_checkpoint(self) -> bool:
        # Gathering full tensors for the checkpoint is a collective over all ranks.
        return True

    def _build_optimizer(self) -> None:
        """fairseq's optimizer over the local shards, wrapped for scaling and clipping
        (:mod:`..sharding.optimizer`).

        Replaces the Trainer's version, whose 16-bit paths build fairseq's FP16 optimizers
        (flat fp32 copies of unsharded parameters) and whose FSDP path needs fairscale.
        """
        params = [
            p for p in chain(self.model.parameters(), self.criterion.parameters())
            if p.requires_grad
        ]
        self._optimizer = build_sharded_optimizer(self.cfg, params, self.settings,
                                                  maxima_reducer(self.device))
        self._lr_scheduler = lr_scheduler.build_lr_scheduler(
            self.cfg.lr_scheduler, self._optimizer
        )
        self._lr_scheduler.step_update(0)
        adam = self._optimizer.optimizer
        if self.host_step is not None and isinstance(adam, ShardedAdam):
            root_unit = len(self.host_step.units) - 1
            owners = owning_units(self.sharding_plan.root.modules[0], self.host_step.units)
            shards = self._optimizer.shards
            # on GPUs the forward's own thread launches kernels beside the step: one core
            # of the rank's share is left to it
            threads = max(1, torch.get_num_threads() - 1) if self.device.type == "cuda" else None
            adam.run_in_background(
                self.host_step,
                {id(local): owners.get(id(param), root_unit)
                 for param, local in zip(shards.params, shards.locals, strict=True)},
                root_unit, threads)
            if adam.native and native_library() is not None:
                logger.info("--cpu-offload: the host's Adam step runs unit by unit in the "
                            "background while the next forward computes the units before "
                            "(--no-host-step-overlap: in line, after backward)")
            else:  # the torch route stays in line (why: the C step's own warning, or SWITCH)
                logger.info(f"--cpu-offload: the host's Adam step runs in torch, in line "
                            f"after backward: the C step is not available (no compiler, or "
                            f"{SWITCH}=0)")

    def wait_for_host_step(self) -> None:
        """Block until the last update's background host step has finished: call it before
        reading parameters or optimizer state between updates outside fairseq's loop
        (state dicts, forwards, validation and checkpoints wait by themselves)."""
        if self.host_step is not None:
            self.host_step.wait_all()

    def clip_grad_norm(self, clip_norm: float) -> torch.Tensor:
        stored_norm = self.engine.grad_norm(self._trainable_params(), self.device)
        return self.optimizer.apply_norm(stored_norm, clip_norm)

    def set_num_updates(self, num_updates: int) -> None:
        # An update skipped for fp16 overflow is not counted, as in fairseq's fp16 training.
        if self._optimizer is not None and self._optimizer.take_skipped_step():
            self._update_skipped = True
            return
        super().set_num_updates(num_updates)

    def _reduce_and_log_stats(self, logging_outputs: Any, sample_size: Any,
                              grad_norm: Any = None) -> Any:
        # fairseq logs nothing for an update skipped for overflow (train_step returns None);
        # every rank skips the same update, so every rank leaves out this collective.
        if getattr(self, "_update_skipped", False):
            self._update_skipped = False
            return None
        return super()._reduce_and_log_stats(logging_outputs, sample_size, grad_norm)

    state_dict_calls = 0  # how many checkpoint states this rank has built (integration hook 5)

    def state_dict(self, filename: str = "checkpoint.pt",
                   training_finished: bool = False) -> dict[str, Any]:
        """A standard fairseq checkpoint with full (gathered) model and optimizer tensors, or
        under ``--checkpoint-format sharded`` an index of the shards just written (DCP).
        A collective: every rank calls it at each save. (The arguments are the nllb
        branch's, whose Trainer returns ``{filename: state}``; 0.12's takes none.)"""
        self.state_dict_calls += 1
        self.saved_at_update = self.get_num_updates()  # (every rank; read by final_saves)
        self.wait_for_host_step()

        def stock_state() -> dict[str, Any]:
            if "filename" not in inspect.signature(Trainer.state_dict).parameters:
                state = Trainer.state_dict(self)
            else:
                (state,) = Trainer.state_dict(self, filename, training_finished).values()
            return with_plain_config(languages_as_lists(state))

        return checkpoint_state(self, stock_state)

    def save_checkpoint(self, filename: str, extra_state: dict[str, Any],
                        training_finished: bool = False, async_callback_fn: Any = None
                        ) -> str | None:
        """Write the checkpoint on the saving rank; a crash never leaves a half-written file.

        fairseq also saves ``crash.pt`` from inside its exception handlers, on whichever
        ranks failed: building a sharded state is collective, so that save would wait for
        ranks that never join it (a hang, or a gloo error hiding the real one). It is
        skipped, and fairseq goes on to raise the original error."""
        if os.path.basename(filename) == "crash.pt":
            logger.warning(f"not saving {filename}: a sharded state cannot be gathered from "
                           "one rank's exception handler")
            return None
        record_ranks(extra_state, self.data_parallel_world_size)
        if not self.should_save_checkpoint_on_current_rank:
            return None
        written = save_full_checkpoint(self, filename, extra_state, training_finished)
        self.written_whole = written  # (fairseq copies it to the save's other names next)
        return written

    def after_checkpoint_save(self) -> None:
        """Called on the saving rank after fairseq's copies and removals (hook 5)."""
        after_save(self)

    def load_checkpoint(self, filename: str, *args: Any, **kwargs: Any) -> Any:
        """Load a full checkpoint into the sharded model: each rank keeps its own slice.

        Anything that stops the load (a truncated or corrupted file, another architecture or
        vocabulary, optimizer state that does not fit) becomes one
        :class:`CheckpointLoadError` naming the file and the mismatch.
        """
        reset_optimizer = bool(args[0] if args else kwargs.get("reset_optimizer", False))
        self.wait_for_host_step()
        stock_shards = first_rank_file(filename)
        if stock_shards:  # fairseq's own fully_sharded saved these; stock would skip them
            logger.info(f"{filename} does not exist: continuing from {stock_shards}, written "
                        "by fairseq's own --ddp-backend fully_sharded")
            filename = stock_shards
        index, fresh_optimizer = None, []
        try:
            index = read_sharded_index(filename)
            if index is None:
                verify_full_checkpoint(filename)
            elif not _among_the_save_dirs_indexes(filename, self.cfg.checkpoint.save_dir):
                # its index lives where the cleanups do not look: they keep it for the run
                self.loaded_shards = shard_directory(filename, index)
            with implicit_replication(), loading_full_tensors_into_shards(self._model), \
                    loading_into_trainer(trainer_state_loader(
                        self, reset_optimizer, record_ranks, lambda: fresh_optimizer.append(1))):
                extra_state = super().load_checkpoint(filename, *args, **kwargs)
            if fresh_optimizer:  # what fairseq restores only along with optimizer state
                self._continue_the_schedule(args[1] if len(args) > 1 else kwargs.get(
                    "reset_lr_scheduler", False))
        except Exception as error:
            scheduler = str(getattr(self.cfg.lr_scheduler, "_name", None))
            if isinstance(error, ShardPluginError):  # the plugin's own one line
                message = str(error)
            elif (schedule := describe_schedule_problem(filename, error, scheduler)):
                message = schedule
            elif index is not None:
                message = f"{filename}: could not be loaded: {first_cause(error)}"
            else:
                message = describe_checkpoint_problem(filename, state_dict_shapes(self._model),
                                                      error)
            if message.startswith(f"{filename}: could not be loaded: "):  # nothing known:
                logger.error(f"loading {filename} failed here:", exc_info=error)  # the trace
            advised = keeping_the_save_dir(message, filename, self.cfg.checkpoint.save_dir)
            if filename == getattr(self.cfg.checkpoint, "finetune_from_model", None):
                advised = for_a_fine_tune(advised)
            if advised is message and isinstance(error, CheckpointLoadError):
                raise
            raise CheckpointLoadError(advised) from error
        self.engine.shard_loaded_state(self.optimizer.optimizer)
        release_checkpoint_pages(self)
        checkpoint_cfg = self.cfg.checkpoint
        # fairseq starts a fresh data iterator for these (a fine-tune resets the dataloader)
        fresh_data = checkpoint_cfg.reset_dataloader or filename == getattr(
            checkpoint_cfg, "finetune_from_model", None)
        converted = None if fresh_data else convert_position(extra_state,
                                                             self.data_parallel_world_size)
        if converted:
            logger.info(converted)
        if extra_state is not None:  # before fairseq starts the epoch's data thread, whose
            # work cut off at exit aborted a process ("terminate called without an active
            # exception") when train_step raised this under --num-workers 0
            refuse_a_step_past_the_end(self.cfg, self.get_num_updates())
        return extra_state

    def _continue_the_schedule(self, reset_lr_scheduler: bool) -> None:
        """After loading a checkpoint saved without optimizer state by its run's choice: its
        update count and (unless reset) learning-rate schedule, as fairseq restores them
        with optimizer state; the optimizer itself starts afresh."""
        last = self._optim_history[-1]
        if not reset_lr_scheduler:
            self.lr_scheduler.load_state_dict(last["lr_scheduler_state"])
        self.set_num_updates(last["num_updates"])

    def valid_step(self, sample: Any, raise_oom: bool = False) -> Any:
        """fairseq's validation step, measured like a training step (the validation log
        line carries its peak); when it also generates (``--eval-bleu`` and the like), with
        the whole model gathered around it (see :func:`..sharding.engines.fsdp2.gathered`). Running
        out of memory stops the run (:mod:`.out_of_memory`): fairseq's retry of the batch
        on the one rank that failed would pair its collectives with the others' next ones."""
        generates = generating_validation_option(self.cfg.task) is not None
        self.wait_for_host_step()  # generation gathers every unit without their forwards

        def step() -> Any:
            with (self.engine.gathered(self.sharding_plan) if generates
                  else contextlib.nullcontext()):
                return super(ShardedTrainer, self).valid_step(sample, raise_oom=True)

        with stop_on_out_of_memory(self.cfg, self.data_parallel_rank, self.get_num_updates(),
                                   validation=True, model=self.get_model()):
            return self._measured(step)

    def train_step(self, samples: Any, raise_oom: bool = False) -> Any:
        """fairseq's step, measured.

        Running out of memory stops the run with :class:`.StepOutOfMemoryError`: fairseq
        would drop the batch on the failed rank only while the others wait in the step's
        collectives (see :mod:`.out_of_memory`). After a FloatingPointError (non-finite
        gradients, or fp16's --min-loss-scale reached) fairseq reruns the step under its
        NanDetector, whose module hooks fail on torch 2 with a bare StopIteration; the
        original error is raised instead, so the log ends with what went wrong. A resumed
        run that is at ``--max-update`` already takes no step (``final_saves``)."""
        refuse_a_step_past_the_end(self.cfg, self.get_num_updates())
        if not self._orphans_removed:
            self._remove_orphaned_shards()
        try:
            with stop_on_out_of_memory(
                    self.cfg, self.data_parallel_rank, self.get_num_updates(),
                    estimate=lambda: out_of_memory_clause(self._run_description, samples,
                                                          self.device),
                    model=self.get_model()):
                logging_output = self._measured(lambda: super(ShardedTrainer, self).train_step(
                    samples, raise_oom=True), log_free_memory=True)
        except StopIteration as error:
            if isinstance(error.__context__, FloatingPointError):
                raise diverged(error.__context__, self.cfg, self.get_num_updates()) from None
            raise
        except FloatingPointError as error:
            raise diverged(error, self.cfg, self.get_num_updates()) from error
        if not self._space_reported:
            self._report_checkpoint_space()
        if self.offload:
            self._log_host_wait()
        return logging_output

    def _remove_orphaned_shards(self) -> None:
        """Before the first update, once the checkpoint to resume from is loaded: the shard
        directories no checkpoint refers to, which a killed or failed save left (they took
        the room the first save needs). The save dir is this run's (``save_dir_claim``)."""
        self._orphans_removed = True
        if self.should_save_checkpoint_on_current_rank and not self.cfg.checkpoint.no_save:
            after_save(self)

    def _log_host_wait(self) -> None:
        """How long this update waited for the host's Adam step: the step's in-line part
        and, with the overlap, the forwards' waits for their units' background updates."""
        adam = self._optimizer.optimizer if self._optimizer is not None else None
        if not isinstance(adam, ShardedAdam):
            return
        waited = adam.take_inline_seconds()
        if self.host_step is not None:
            waited += self.host_step.take_waited_seconds()
        metrics.log_scalar("host_wait", waited, priority=1400, round=3)

    def _report_checkpoint_space(self) -> None:
        """Once the optimizer state exists: log a checkpoint's size against the save dir's
        free space, with a warning if a save will not fit (:mod:`..checkpoint.space`)."""
        optimizer = self.optimizer
        state = optimizer.optimizer.state
        if not state:  # before the first real step (fp16 may skip the first ones)
            return
        self._space_reported = True
        checkpoint = self.cfg.checkpoint
        if checkpoint.no_save or not self.is_data_parallel_master:
            return
        saves_state = not checkpoint.no_save_optimizer_state
        triples = [(param, local, state.get(local, {}) if saves_state else {})
                   for param, local in zip(optimizer.shards.params, optimizer.shards.locals,
                                           strict=True)]
        saved_as = checkpoint_format(self.cfg)
        size = full_state_bytes(triples, self.shard_group_size, saved_as)
        try:  # the pickled config and names, the zip records: a fixed part of the size
            size += structure_bytes(self._checkpoint_structure(triples), saved_as)
        except Exception as error:  # noqa: BLE001 (an estimate's part, never a stop)
            logger.info(f"checkpoint size without its structure ({type(error).__name__}: "
                        f"{error})")
        try:
            line, too_little = space_report(checkpoint.save_dir, size, saved_as,
                                            checkpoint_cfg=checkpoint)
        except OSError as error:  # a notice only: never a reason to stop training
            logger.info(f"free space of {checkpoint.save_dir} unknown: {error}")
            return
        (logger.warning if too_little else logger.info)(line)

    def _checkpoint_structure(self, triples: list[tuple[torch.Tensor, torch.Tensor, dict]]
                              ) -> dict[str, Any]:
        """What a checkpoint of this run holds besides the tensors ``full_state_bytes``
        counts, for ``structure_bytes``: fairseq's state layout with the saved config, the
        model's names (tied ones sharing their tensor), the meters and the optimizer
        state's entries; tensors as they are (never gathered: no collective)."""
        names: dict[int, list[str]] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        model: dict[str, Any] = {}
        for index, (param, _, _) in enumerate(triples):
            model.update(dict.fromkeys(names.get(id(param), [f"parameter{index}"]), param))
        groups = [{**{key: value for key, value in group.items() if key != "params"},
                   "params": list(range(len(group["params"])))}
                  for group in self.optimizer.optimizer.param_groups]
        cfg = (OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True)
               if OmegaConf.is_config(self.cfg) else self.cfg)
        state = {"args": None, "cfg": cfg, "model": model, "optimizer_history": [],
                 "extra_state": {"metrics": metrics.state_dict()}}
        if not self.cfg.checkpoint.no_save_optimizer_state:
            state["last_optimizer_state"] = {
                "state": {index: entries for index, (_, _, entries) in enumerate(triples)},
                "param_groups": groups}
        return with_plain_config(state)

    def _measured(self, step: Callable[[], Any], log_free_memory: bool = False) -> Any:
        """Run ``step`` and log its peak memory (max over ranks; a collective)."""
        if self._memory_probe is None:
            return step()
        if self.offload:  # model state lives on the host: not accelerator memory
            buffers = chain(self._model.buffers(), self._criterion.buffers())
            self._memory_probe.start(buffers, host=self._model_state_tensors())
        else:
            self._memory_probe.start(self._resident_tensors())
        try:
            logging_output = step()
        finally:
            step_memory = self._memory_probe.stop()
        log_step_memory(step_memory, storage_bytes(self._model_state_tensors()), self.device,
                        offloaded=self.offload)
        if log_free_memory and self._cuda_environment is not None and step_memory is not None:
            metrics.log_scalar("gb_free", self._cuda_environment.total_memory_in_GB
                               - step_memory.peak_allocated / GIB,
                               priority=1500, round=1, weight=0)
        return logging_output

    def _trainable_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.optimizer.params if p.requires_grad]

    def _resident_tensors(self) -> Iterator[torch.Tensor]:
        """Tensors alive between steps: model state and buffers."""
        for module in (self._model, self._criterion):
            yield from module.buffers()
        yield from self._model_state_tensors()

    def _model_state_tensors(self) -> Iterator[torch.Tensor]:
        """Parameters, gradients and optimizer state: what sharding divides by N."""
        for module in (self._model, self._criterion):
            yield from module.parameters()
        for param in self.optimizer.params:
            if param.grad is not None:
                yield param.grad
        for state in self.optimizer.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
