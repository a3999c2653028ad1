"""Refuse configurations that cannot work, before any training starts, naming the flag."""

from __future__ import annotations

import errno
import os
import re
import secrets
from pathlib import Path
from typing import Any

from fairseq.models.transformer.transformer_config import DEFAULT_MIN_PARAMS_TO_WRAP

from fairseq_shard_plugin.checkpoint.atomic_files import describe_os_error, new_file_refused
from fairseq_shard_plugin.checkpoint.consolidate import export_target_problem
from fairseq_shard_plugin.checkpoint.portable import config_entry, saved_without_optimizer_state
from fairseq_shard_plugin.checkpoint.reading import read_checkpoint
from fairseq_shard_plugin.checkpoint.sharded import SHARDS_DIR, is_sharded_index
from fairseq_shard_plugin.errors import ShardingConfigError
from fairseq_shard_plugin.hydra_keys import running_under_hydra
from fairseq_shard_plugin.sharding.optimizer import (
    OTHER_ELEMENT_WISE,
    is_element_wise,
    not_element_wise,
)
from fairseq_shard_plugin.sharding.options import checkpoint_format, sharding_options
from fairseq_shard_plugin.sharding.settings import shard_group_size
from fairseq_shard_plugin.torch_support import installed_torch, release
from fairseq_shard_plugin.training.launch_env import launched_by_torchrun, uses_cuda
from fairseq_shard_plugin.training.signal_stop import parse_signals


def is_sharded_run(cfg: Any) -> bool:
    return cfg.distributed_training.ddp_backend == "fully_sharded"


def check_sharded_config(cfg: Any) -> None:
    """Raise :class:`ShardingConfigError` for a sharded run that cannot work."""
    check_branch_options(cfg)  # first: what no other flag makes workable (adam8bit, MoE)
    _check_fairseq_features(cfg)
    _check_plugin_options(cfg)
    _check_values(cfg)
    _check_parallelism_and_launch(cfg)
    _check_restore_file(cfg.checkpoint)
    _check_save_dir_entries(cfg)
    check_fairscale_engine(cfg)


def check_batch_size(cfg: Any) -> None:
    """A training needs --max-tokens or --batch-size (fairseq asserts it, with a traceback,
    once the data is loaded) and an --optimizer; checked where fairseq-train starts, not
    where a trainer is built (tools build trainers without a data loader)."""
    if cfg.dataset.max_tokens is None and cfg.dataset.batch_size is None:
        raise ShardingConfigError("give --max-tokens N (target tokens per batch and rank) "
                                  "or --batch-size N")
    if getattr(cfg.optimizer, "_name", None) is None:  # fairseq: "optimizer is required!"
        # with a traceback, after the model is built (the plugin's: an AttributeError)
        raise ShardingConfigError(f"give --optimizer (adam for the NLLB recipe; "
                                  f"{OTHER_ELEMENT_WISE} also shard exactly)")


def _check_fairseq_features(cfg: Any) -> None:
    """fairseq's training features that need an unsharded model or another wrapper."""
    common, dist_cfg = cfg.common, cfg.distributed_training
    if common.amp:
        raise ShardingConfigError(
            "--amp is not supported with --ddp-backend fully_sharded: use --fp16 or --bf16"
        )
    if getattr(cfg.model, "quant_noise_pq", 0):
        raise ShardingConfigError(
            "--quant-noise-pq rewrites weights inside forward (weight.data = ...), which a "
            "sharded unit writes into its gathered copy and drops, so training would differ "
            "from fairseq's: remove --quant-noise-pq, or train with another --ddp-backend")
    if cfg.ema.store_ema:
        raise ShardingConfigError(
            "--store-ema keeps an unsharded model copy and is not supported with "
            "--ddp-backend fully_sharded: remove --store-ema"
        )
    if dist_cfg.zero_sharding != "none":
        raise ShardingConfigError(
            "--zero-sharding is redundant with --ddp-backend fully_sharded (optimizer state "
            "is already sharded): remove --zero-sharding"
        )
    if cfg.optimization.use_bmuf:
        raise ShardingConfigError("--use-bmuf cannot be combined with --ddp-backend fully_sharded")
    if (common.memory_efficient_fp16 or common.memory_efficient_bf16) and (
            cfg.optimizer._name != "adam"):
        flag = "fp16" if common.memory_efficient_fp16 else "bf16"
        if not is_element_wise(cfg.optimizer):  # refused with --fp16/--bf16 too
            raise not_element_wise(cfg.optimizer._name, sixteen_bit=flag)
        raise ShardingConfigError(
            f"--memory-efficient-{flag} keeps the shards in 16 bits, which only --optimizer "
            f"adam updates in fp32 under the plugin: use --{flag} (fp32 master shards) with "
            f"--optimizer {cfg.optimizer._name}")


def _check_plugin_options(cfg: Any) -> None:
    """The plugin's own options, alone and against fairseq's checkpoint and precision flags."""
    dist_cfg = cfg.distributed_training
    options = sharding_options(cfg.task)
    if options.shard_group_size < 0:
        raise ShardingConfigError(
            f"--shard-group-size {options.shard_group_size}: give the ranks of one shard group "
            "(a divisor of the world size), or 0 for the ranks per node")
    if options.shard_strategy == "hybrid":
        if options.shard_engine != "fsdp2":
            raise ShardingConfigError(
                "--shard-strategy hybrid needs --shard-engine fsdp2 (a 2-D device mesh)"
            )
        # under fairseq-hydra-train the world size is only known from torchrun here
        world_size = (int(os.environ["WORLD_SIZE"]) if launched_by_torchrun()
                      else dist_cfg.distributed_world_size)
        shard_group_size(options, world_size)
    try:
        parse_signals(options.save_on_signal)
    except ValueError as error:
        raise ShardingConfigError(str(error)) from None
    if checkpoint_format(cfg) == "sharded" and options.shard_engine != "fsdp2":
        raise ShardingConfigError(
            "--checkpoint-format sharded writes DTensor shards and needs --shard-engine fsdp2: "
            "use --checkpoint-format full with the fairscale engine"
        )
    given = [flag for flag, on in (("--no-save", cfg.checkpoint.no_save),
                                   ("--no-last-checkpoints", cfg.checkpoint.no_last_checkpoints))
             if on]
    if options.export_consolidated and given:  # (the flags that are set: T1 #6, session 25)
        several = len(given) > 1
        raise ShardingConfigError(
            f"--export-consolidated exports the final checkpoint_last.pt, which "
            f"{' and '.join(given)} {'leave' if several else 'leaves'} unwritten: remove "
            f"{'them' if several else 'it'} (false under Hydra), or the export")
    if cfg.checkpoint.write_checkpoints_asynchronously:
        raise ShardingConfigError(
            "--write-checkpoints-asynchronously (iopath's background writer) cannot keep the "
            "plugin's checkpoint writes atomic: remove it (--checkpoint-format sharded makes "
            "saves fast instead: each rank writes only its shards)"
        )
    if options.layers_per_unit < 1:
        raise ShardingConfigError(
            f"--layers-per-unit {options.layers_per_unit}: give 1 (every layer its own unit) "
            "or more")
    if dist_cfg.fp32_reduce_scatter and options.reduce_in_16_bit:
        raise ShardingConfigError(
            "--fp32-reduce-scatter and --reduce-in-16-bit contradict each other: drop one "
            "(gradients reduce in fp32 by default under the plugin)"
        )


def check_any_backend(cfg: Any) -> None:
    """What the plugin's task and criterion need under every ``--ddp-backend``, and what
    stock backends cannot do on the CPU ranks the plugin sets up."""
    dist_cfg = cfg.distributed_training
    if (dist_cfg.ddp_backend in ("pytorch_ddp", "c10d") and dist_cfg.distributed_world_size > 1
            and not uses_cuda(cfg)):
        raise ShardingConfigError(
            f"--ddp-backend {dist_cfg.ddp_backend} (fairseq's default) cannot train on CPU "
            "ranks: fairseq gives DistributedDataParallel a device id, which CPU modules "
            "refuse; use --ddp-backend fully_sharded (the plugin's sharding) or legacy_ddp")
    chunk = getattr(cfg.criterion, "loss_chunk_tokens", None)
    if chunk is not None and chunk < 1:
        raise ShardingConfigError(
            f"--loss-chunk-tokens {chunk}: give at least 1 (the number of target tokens "
            "whose logits exist at once; 1024 by default)")


def _check_values(cfg: Any) -> None:
    """Numbers and paths that would fail only once training runs (or, for the export, once
    it has finished)."""
    check_any_backend(cfg)
    common, schedule = cfg.common, cfg.optimization.update_freq
    if (common.fp16 or common.memory_efficient_fp16) and common.fp16_scale_window is None \
            and len(schedule) > 1:
        raise ShardingConfigError(
            f"--update-freq {','.join(map(str, schedule))} is a schedule: give "
            "--fp16-scale-window N with it (fairseq derives the loss scale's window from a "
            "single --update-freq)")
    target = sharding_options(cfg.task).export_consolidated
    problem = unwritable_file(target) if target else None
    if problem:
        raise ShardingConfigError(
            f"--export-consolidated {target}: {problem}; the export would fail only after "
            "training: give a path that can be written")
    problem = export_target_problem(target, save_dir=cfg.checkpoint.save_dir) if target else None
    if problem:
        raise ShardingConfigError(
            f"--export-consolidated {target}: refused: {problem}; name another file (e.g. "
            "model.pt)")


def unwritable_file(target: str) -> str | None:
    """Why a file could not be written at ``target`` (its directories created as needed),
    or None. Checked before training by trying: in an existing directory, the export's own
    temporary file is created and removed (``os.access`` says yes to root, also for
    ``/proc``); where directories are still to be made, one is made and removed in the
    nearest existing one. The export itself still reports what the system refuses."""
    path = Path(target)
    try:
        if path.is_dir():
            return "it is a directory (name the file, e.g. model.pt inside it)"
        ancestor = path.parent
        while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        if ancestor.is_symlink() and not ancestor.exists():
            return f"{ancestor} is a link to nothing ({os.readlink(ancestor)})"
        if not ancestor.is_dir():
            return f"{ancestor} is not a directory"
    except OSError as error:  # a name too long, a loop of links, a directory not searchable
        return describe_os_error(error)
    if ancestor != path.parent:  # made by the export: the ancestor must allow that
        probe = ancestor / f".export-probe-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            os.mkdir(probe, 0o700)
            os.rmdir(probe)
        except OSError as error:
            return f"{ancestor} does not take a new directory: {describe_os_error(error)}"
        return None
    refused = new_file_refused(path)
    if refused is None:
        return None
    if refused.errno == errno.ENAMETOOLONG:
        return (f"the name is too long for the export's temporary file beside it "
                f"(.NAME.partial-...): {describe_os_error(refused)}")
    return f"{path.parent} does not take a new file: {describe_os_error(refused)}"


def reset_flags_given(checkpoint_cfg: Any) -> list[str]:
    """fairseq's ``--reset-*`` flags the run gives, as flags."""
    return ["--reset-" + flag.replace("_", "-")
            for flag in ("optimizer", "lr_scheduler", "meters", "dataloader")
            if getattr(checkpoint_cfg, f"reset_{flag}", False)]


def _check_restore_file(checkpoint_cfg: Any) -> None:
    """An explicit ``--restore-file`` (or, on a first launch, ``--finetune-from-model``) that
    is not a file: fairseq would log "No existing checkpoint found" and train from scratch
    (for a directory too), which is never what naming a checkpoint meant, or stop with a
    traceback on every rank."""
    suffix = checkpoint_cfg.checkpoint_suffix or ""
    restore = checkpoint_cfg.restore_file
    if restore != "checkpoint_last.pt" and "://" not in restore:  # not the save dir's own
        named = restore.replace(".pt", f"{suffix}.pt")
        in_save_dir = os.path.join(checkpoint_cfg.save_dir, named)
        advice = (f"{os.path.normpath(os.path.join(checkpoint_cfg.save_dir, restore))} "
                  "(--restore-file is read from the working directory, not the save dir)"
                  if not os.path.isabs(named) and os.path.isfile(in_save_dir)
                  else "an existing checkpoint, or leave --restore-file out to resume from "
                  "the save dir's checkpoint_last.pt")
        _check_checkpoint_file("--restore-file", named, advice)
    finetune = getattr(checkpoint_cfg, "finetune_from_model", None)
    resets = reset_flags_given(checkpoint_cfg)
    last = os.path.join(checkpoint_cfg.save_dir, f"checkpoint_last{suffix}.pt")
    if finetune and resets:  # fairseq's ValueError, in a traceback once the model is built
        raise ShardingConfigError(
            f"--finetune-from-model resets the optimizer, learning rate schedule, meters and "
            f"data position itself when it starts: remove {', '.join(resets)} "
            "(checkpoint.reset_*)" + (f"; {last} exists, so fairseq resumes it instead of "
                                      "loading --finetune-from-model: give a new --save-dir "
                                      "to fine-tune" if os.path.isfile(last) else ""))
    if finetune and restore != "checkpoint_last.pt":  # the same ValueError
        raise ShardingConfigError(
            f"--finetune-from-model {finetune} and --restore-file {restore} name two "
            "checkpoints to start from: keep one (--finetune-from-model loads its file only "
            "while the save dir has no checkpoint_last.pt)")
    if finetune and "://" not in finetune and not os.path.exists(last):  # fairseq reads it
        _check_checkpoint_file("--finetune-from-model", finetune,
                               "the path of an existing checkpoint file")


def _check_save_dir_entries(cfg: Any) -> None:
    """What the save dir holds under the names a run resumes from and saves to: a directory
    or a dangling link as ``checkpoint_last.pt`` (or stock ``fully_sharded``'s
    ``-shard0.pt``) made fairseq train from scratch and save over the save dir's
    checkpoints; a file as ``checkpoint_shards`` failed only at the first sharded save."""
    checkpoint_cfg = cfg.checkpoint
    save_dir = Path(checkpoint_cfg.save_dir)
    last = save_dir / f"checkpoint_last{checkpoint_cfg.checkpoint_suffix or ''}.pt"
    for name in (last, last.with_name(last.stem + "-shard0.pt")):
        if os.path.lexists(name) and not name.is_file():
            what = ("a directory" if name.is_dir() else "a link to nothing"
                    if name.is_symlink() else "a FIFO, socket or device")
            raise ShardingConfigError(
                f"{name} is {what}, not a checkpoint: fairseq would train from scratch and "
                f"then save over {save_dir}'s checkpoints; move it out of the save dir")
    shards = save_dir / SHARDS_DIR
    if checkpoint_format(cfg) == "sharded" and os.path.lexists(shards) and not shards.is_dir():
        what = (f"a link to {os.readlink(shards)}, which does not exist" if shards.is_symlink()
                else "a file")
        raise ShardingConfigError(
            f"{shards} is {what}: sharded checkpoints keep their shards in that directory; "
            "move it away (or link it to an existing directory)")


def _check_checkpoint_file(flag: str, path: str, advice: str) -> None:
    """Refuse ``path`` given by ``flag`` unless it is a file (a directory: name one in it)."""
    if os.path.isdir(path):
        inside = sorted(Path(path).glob("*.pt"))
        example = os.path.join(path, "checkpoint_last.pt") if (
            Path(path) / "checkpoint_last.pt").is_file() or not inside else str(inside[0])
        raise ShardingConfigError(
            f"{flag} {path} is a directory (fairseq would train from scratch without a "
            f"word): give a checkpoint file in it, such as {example}")
    if not os.path.exists(path):
        raise ShardingConfigError(f"{flag} {path}: no such file: give {advice}")


def _check_parallelism_and_launch(cfg: Any) -> None:
    """Other parallelism, TPUs, and how CPU ranks are started."""
    common, dist_cfg = cfg.common, cfg.distributed_training
    if common.model_parallel_size > 1 or dist_cfg.pipeline_model_parallel:
        raise ShardingConfigError(
            "model/pipeline parallelism cannot be combined with --ddp-backend fully_sharded: "
            "remove --model-parallel-size/--pipeline-model-parallel"
        )
    if common.tpu:
        raise ShardingConfigError("--tpu is not supported with --ddp-backend fully_sharded: "
                                  "remove --tpu, or use another --ddp-backend")
    if (
        not uses_cuda(cfg)
        and dist_cfg.distributed_world_size > 1
        and dist_cfg.distributed_init_method is None
        and not launched_by_torchrun()
    ):
        command = "fairseq-hydra-train" if running_under_hydra() else "fairseq-train"
        raise ShardingConfigError(
            f"{dist_cfg.distributed_world_size} CPU ranks need a launcher: run "
            f"`torchrun --nproc_per_node {dist_cfg.distributed_world_size} "
            f"$(which {command}) ...` instead of --distributed-world-size"
        )


def ignored_fsdp_flags(cfg: Any) -> list[str]:
    """fairseq's fairscale-FSDP flags given to a sharded run that the plugin does not use,
    each with why (recipes carry them, so they are logged, not refused)."""
    ignored = []
    wrap = getattr(cfg.model, "min_params_to_wrap", DEFAULT_MIN_PARAMS_TO_WRAP)
    if wrap is not None and wrap != DEFAULT_MIN_PARAMS_TO_WRAP:
        ignored.append("--min-params-to-wrap (every encoder and decoder layer is a unit, "
                       "whatever its size)")
    if cfg.distributed_training.not_fsdp_flatten_parameters:
        ignored.append("--not-fsdp-flatten-parameters (fsdp2 keeps parameters unflattened; "
                       "the fairscale engine always flattens)")
    return ignored


def check_branch_options(cfg: Any) -> None:
    """Options of fairseq's nllb branch (and MoE layers, also in 0.12) that the plugin
    cannot honour; read with defaults, since 0.12 lacks most of them."""
    model, checkpoint = cfg.model, cfg.checkpoint
    moe = ("mixture-of-experts layers are outside the plugin's wrap policy: remove it, or "
           "train without the plugin")
    unworkable = {  # flag: (given, why and what to do)
        "--moe-freq": ((getattr(model, "moe_freq", 0) or 0) > 0, moe),
        "--base-layers": ((getattr(model, "base_layers", 0) or 0) > 0, moe),
        "--init-model-on-gpu": (bool(getattr(model, "init_model_on_gpu", False)),
                                "it builds 16-bit parameters where the plugin keeps fp32 "
                                "master shards: remove it"),
        "--optimizer adam8bit": (getattr(cfg.optimizer, "_name", None) == "adam8bit",
                                 "its blockwise-quantised state cannot be sharded per "
                                 "element: use --optimizer adam"),
        "--s3-upload-path": (bool(getattr(checkpoint, "s3_upload_path", None)),
                             "it needs asynchronous checkpoint writes, which cannot stay "
                             "atomic: upload the saved files separately"),
    }
    for flag, (given, advice) in unworkable.items():
        if given:
            raise ShardingConfigError(
                f"{flag} is not supported with --ddp-backend fully_sharded: {advice}")


# Task options (fairseq 0.12's translation, audio and speech tasks) that make valid_step
# generate with the model besides computing the loss.
GENERATING_VALIDATION_OPTIONS = ("eval_bleu", "eval_wer", "eval_wer_parse", "eval_inference")


def generating_validation_option(task_cfg: Any) -> str | None:
    """The option, as a flag, that makes validation generate (e.g. ``--eval-bleu``), if any."""
    for name in GENERATING_VALIDATION_OPTIONS:
        if getattr(task_cfg, name, False) is True:
            return "--" + name.replace("_", "-")
    return None


def check_fairscale_engine(cfg: Any) -> None:
    """``--shard-engine fairscale`` runs on CUDA streams, without the FSDP2-only features."""
    if getattr(cfg.task, "shard_engine", None) != "fairscale":
        return
    generating = generating_validation_option(cfg.task)
    unsupported = {
        "--cpu-offload": cfg.distributed_training.cpu_offload,
        "--shard-strategy hybrid": getattr(cfg.task, "shard_strategy", "full") == "hybrid",
        "--reduce-vocabulary-in-16-bit": bool(
            getattr(cfg.task, "reduce_vocabulary_in_16_bit", False)
        ),
        # fairscale FSDP wraps one module per unit
        "--layers-per-unit above 1": (getattr(cfg.task, "layers_per_unit", 1) or 1) > 1,
        "--criterion chunked_label_smoothed_cross_entropy":
            getattr(cfg.criterion, "_name", None) == "chunked_label_smoothed_cross_entropy",
        # generation calls submodules directly: the plugin gathers FSDP2 units around it
        f"{generating} (generation in validation)": generating is not None,
    }
    for flag, given in unsupported.items():
        if given:
            raise ShardingConfigError(
                f"{flag} is not supported with --shard-engine fairscale: use --shard-engine "
                "fsdp2 (or drop it)"
            )
    if not uses_cuda(cfg):
        reason = "--cpu was given" if cfg.common.cpu else "no CUDA device is available"
        raise ShardingConfigError(
            f"--shard-engine fairscale needs CUDA (fairscale FSDP runs on CUDA streams) and "
            f"{reason}: use --shard-engine fsdp2"
        )


def finetune_not_loaded(checkpoint_cfg: Any) -> str | None:
    """A warning when ``--finetune-from-model`` will not be loaded: fairseq loads it only
    into a save dir without ``checkpoint_last.pt`` (so that a preempted fine-tune resumes)
    and otherwise resumes that file, whoever wrote it (another run's: its Adam state and
    schedule went on under the new settings, without a word, T3 #3). Nothing is said where
    the save dir's last checkpoint is this fine-tune's own."""
    finetune = getattr(checkpoint_cfg, "finetune_from_model", None)
    suffix = checkpoint_cfg.checkpoint_suffix or ""
    last = Path(checkpoint_cfg.save_dir) / f"checkpoint_last{suffix}.pt"
    if not finetune or not last.is_file():
        return None
    try:
        cfg = read_checkpoint(last, "meta").get("cfg")
    except Exception:  # the resume itself reports a file it cannot read
        return None
    started_from = config_entry(config_entry(cfg, "checkpoint"), "finetune_from_model")
    if started_from and _same_file(str(started_from), finetune):
        return None  # this fine-tune's own checkpoint: a resume, as fairseq means it
    return (f"--finetune-from-model {finetune} is not loaded: {last} exists and fairseq "
            f"resumes it instead (its optimizer state, schedule and data position), as it "
            f"does for a preempted fine-tune; it was not written by a fine-tune from that "
            f"file, so give a new --save-dir to start the fine-tune")


def _same_file(stored: str, given: str) -> bool:
    """Whether a path stored by an earlier launch names the file ``given`` names now: the
    same resolved path, or (a relative path stored from another working directory, a
    requeue's ``cd``) the same last components."""
    if os.path.realpath(stored) == os.path.realpath(given):
        return True
    if os.path.isabs(stored) and os.path.isabs(given):
        return False
    stored_parts = Path(os.path.normpath(stored)).parts
    given_parts = Path(os.path.normpath(given)).parts
    tail = min(len(stored_parts), len(given_parts))
    return stored_parts[-tail:] == given_parts[-tail:]


def check_a_lost_last_checkpoint(checkpoint_cfg: Any) -> None:
    """A save dir that holds a run's checkpoints but no ``checkpoint_last.pt`` (deleted, a
    first save that failed, or ``--no-last-checkpoints``): fairseq starts from scratch
    without a word and saves over every one of them (T2 #1). Refused, naming the newest; a
    run that names what to start from (``--restore-file``, ``--finetune-from-model``) or
    saves nothing goes on. Only regular files under the names this run writes (its
    ``--checkpoint-suffix``) that hold training state count: not exports, other suffixes'
    files or a FIFO (never opened)."""
    if (checkpoint_cfg.no_save or checkpoint_cfg.restore_file != "checkpoint_last.pt"
            or getattr(checkpoint_cfg, "finetune_from_model", None)
            or "://" in str(checkpoint_cfg.save_dir)):
        return
    suffix = checkpoint_cfg.checkpoint_suffix or ""
    save_dir = Path(checkpoint_cfg.save_dir)
    last = save_dir / f"checkpoint_last{suffix}.pt"
    if not save_dir.is_dir() or os.path.lexists(last) or os.path.lexists(
            last.with_name(last.stem + "-shard0.pt")):
        return
    names = re.compile(rf"checkpoint(\d+|_\d+_\d+|_best|\.best_[^/]+?){re.escape(suffix)}\.pt")
    updates = {}
    for path in save_dir.iterdir():
        if not names.fullmatch(path.name) or not path.is_file():
            continue
        try:
            state = read_checkpoint(path, "meta")
            if not ("last_optimizer_state" in state or is_sharded_index(state)
                    or saved_without_optimizer_state(state)):
                continue  # an export: nothing a resume would take
            updates[path] = int(state["optimizer_history"][-1]["num_updates"])
        except Exception:  # not a readable training checkpoint: not one a restart loses
            continue
    if not updates:
        return
    newest = max(updates, key=lambda path: (updates[path], "best" not in path.name, path.name))
    why = (f"this run writes no {last.name} (--no-last-checkpoints)"
           if checkpoint_cfg.no_last_checkpoints else f"it has no {last.name}")
    raise ShardingConfigError(
        f"{save_dir} holds {len(updates)} training checkpoint(s) and {why}, so fairseq "
        f"would train from scratch and save over them: to resume, give --restore-file "
        f"{newest} (the newest, update {updates[newest]}; fairseq-shard-verify {save_dir} "
        "checks them); to start anew, give another --save-dir")


# torch releases whose FSDP2 runs a validation forward through the chunked loss with the
# vocabulary unit's weight left sharded ("aten.embedding.default got mixed torch.Tensor and
# DTensor", at the first validation, after training): 2.11 (by hand, 2026-12-06); 2.13
# passes the suite; 2.12 was not checked
_CHUNKED_VALIDATION_FAILS_BEFORE = (2, 13)


def check_chunked_validation(cfg: Any, torch_version: str | None = None) -> None:
    """Refuse, before training, a validation that would fail on this torch (or
    ``torch_version``) only once the first validation comes (after an epoch or
    --validate-interval-updates of training)."""
    if (getattr(cfg.criterion, "_name", None) != "chunked_label_smoothed_cross_entropy"
            or cfg.dataset.disable_validation):
        return
    version = torch_version or installed_torch() or ""
    major_minor = release(version)
    if major_minor is not None and major_minor < _CHUNKED_VALIDATION_FAILS_BEFORE:
        raise ShardingConfigError(
            f"validation through --criterion chunked_label_smoothed_cross_entropy fails "
            f"inside torch {version}'s FSDP2 at the first validation (checked: 2.11 fails, "
            "2.13 works): add --disable-validation, use the stock "
            "label_smoothed_cross_entropy, or upgrade torch to >= 2.13")
