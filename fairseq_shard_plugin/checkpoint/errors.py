"""Explain, in one line, why a checkpoint could not be loaded into the model."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from fairseq_shard_plugin.checkpoint.atomic_files import WriteError
from fairseq_shard_plugin.checkpoint.integrity import RESUME_HINT, is_truncated_zip
from fairseq_shard_plugin.checkpoint.portable import config_entry
from fairseq_shard_plugin.checkpoint.reading import (
    NotACheckpointError,
    checkpoint_format,
    read_checkpoint,
)
from fairseq_shard_plugin.errors import ShardPluginError


class CheckpointLoadError(ShardPluginError, RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file and the mismatch."""


# the advice of every refusal of a checkpoint's optimizer state (the plugin's, stock fairseq's
# and fairscale's layouts alike), which keeping_the_save_dir adapts to a resume
RESET_OPTIMIZER = "add --reset-optimizer to start the optimizer afresh"


def in_save_dir(filename: str, save_dir: str) -> bool:
    """Whether ``filename`` is a file of ``save_dir`` itself (links to the directories
    resolved; the file itself may be a link to elsewhere)."""
    # joined, not normalised: "link/../x" is the parent of the link's target, as the
    # file system reads it, not the folder that holds the link
    return (os.path.realpath(os.path.dirname(os.path.join(os.getcwd(), filename)))
            == os.path.realpath(save_dir))


def keeping_the_save_dir(message: str, filename: str, save_dir: str) -> str:
    """``message`` where its advice to add --reset-optimizer concerns a checkpoint of the save
    dir itself (a resume): fairseq would then restart at update 0 and save over that save
    dir's checkpoints, so the advice says so and how to keep them."""
    if RESET_OPTIMIZER not in message or not in_save_dir(filename, save_dir):
        return message
    return message.replace(RESET_OPTIMIZER, (
        f"to train on from its weights with a fresh optimizer, give --finetune-from-model "
        f"{filename} and a new --save-dir (--reset-optimizer would restart at update 0 and "
        "save over this save dir's checkpoints)"))


def for_a_fine_tune(message: str) -> str:
    """``message`` about the checkpoint ``--finetune-from-model`` names: its advice to resume
    from another file with --restore-file was the wrong fix there (T2 #4, session 25)."""
    return message.replace(RESUME_HINT, "give --finetune-from-model an intact checkpoint "
                           "(fairseq-shard-verify FILE checks one)")


class CheckpointWriteError(WriteError):
    """A checkpoint save the system refused (a full disk, say); says how to go on."""


def save_failure(error: WriteError, save_dir: str) -> CheckpointWriteError:
    """``error`` with what to do: free space (where space ran out), raise a file size limit
    (where a file outgrew one), else fix what the error names; then resume from the intact
    checkpoints (or start afresh, where no checkpoint was saved yet). The error may come
    from another rank, as text: its errno name says."""
    if "(EFBIG)" in str(error):  # freeing space would not help: the next try fails alike
        smaller = ("train on more ranks (a smaller shard file each)"
                   if "the shards of update" in str(error)  # sharded already
                   else "save with --checkpoint-format sharded (a smaller file per rank)")
        fix = ("A checkpoint file outgrew a file size limit (the shell's ulimit -f, or the "
               "file system's largest file): raise it, give a --save-dir on another file "
               f"system, or {smaller},")
    elif any(f"({name})" in str(error) for name in _OUT_OF_SPACE):
        fix = f"Free space in {save_dir}"
    elif "(a short write: " in str(error):  # torch's writer hid the system's error
        fix = (f"Free space in {save_dir} (or, where a file size limit stopped it, raise "
               "the limit: ulimit -f)")
    else:
        fix = "Fix that"
    if not any(Path(save_dir).glob("checkpoint_last*.pt")):
        if "was written whole before it" in str(error):  # the copy the error names
            return CheckpointWriteError(f"{error}. {fix} and run the same command again")
        return CheckpointWriteError(
            f"{error}. {fix} and run the same command again: no checkpoint was saved yet, "
            "so it starts afresh")
    return CheckpointWriteError(
        f"{error}. {fix} and run the same command again: it resumes from "
        "checkpoint_last.pt (fairseq-shard-verify checks what is there)")


_OUT_OF_SPACE = ("ENOSPC", "EDQUOT")  # as atomic_files.describe_os_error names them


def tensor_shapes(model_state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shapes of the tensors of a checkpoint's ``model`` entry (other values skipped)."""
    return {name: tuple(tensor.shape) for name, tensor in model_state.items()
            if isinstance(tensor, torch.Tensor)}


def state_dict_shapes(module: torch.nn.Module) -> dict[str, torch.Size]:
    """The names and shapes ``module.state_dict()`` has, without calling it (no collective):
    tied parameters under every name that holds them, and persistent buffers."""
    shapes: dict[str, torch.Size] = {}
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, tensor in submodule._parameters.items():
            if tensor is not None:
                shapes[dot + name] = tensor.shape
        for name, tensor in submodule._buffers.items():
            if tensor is not None and name not in submodule._non_persistent_buffers_set:
                shapes[dot + name] = tensor.shape
    return shapes


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


# torch's load_state_dict collects each parameter's failure under this heading
_LOAD_STATE_DICT_HEADING = "Error(s) in loading state_dict for "


def _innermost(error: BaseException) -> BaseException:
    seen = {id(error)}
    while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        error = inner
    return error


def first_cause(error: BaseException) -> str:
    """The innermost exception behind ``error`` as ``Type: first line``.

    fairseq re-raises a failed ``load_state_dict`` as "please ensure that the architectures
    match", whatever the reason; the reason is the exception it was raised from (or during).
    torch's ``load_state_dict`` error lists each parameter's failure after a heading line:
    the first of them is the line that says what went wrong.
    """
    error = _innermost(error)
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith(_LOAD_STATE_DICT_HEADING):
        return f"{type(error).__name__}: {lines[1]}"
    return _first_line(error)


# how torch's weights_only unpickler names a type it refused, in its three messages
_REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)"
                             r"|allowlisted via `add_safe_globals`, but got <class '([^']+)'>"
                             r"|unsupported GLOBAL (\S+) whose module \S+ is blocked")


def describe_unreadable(filename: str | Path, error: BaseException) -> str:
    """One line for a checkpoint ``read_checkpoint`` could not read: a file of neither torch
    format, a pickled type outside the allow-list (named), or a damaged file."""
    if isinstance(error, NotACheckpointError):
        return f"{filename}: {error}"
    refused = _REFUSED_GLOBAL.search(str(error))
    if refused:
        name = next(group for group in refused.groups() if group)
        return (f"{filename}: holds a pickled {name}, which the plugin does not load "
                "(weights_only=True: unpickling it could run code); re-save the checkpoint "
                "without it where it was written")
    protocol = _legacy_pickle_protocol(filename)
    if isinstance(error, pickle.UnpicklingError) and protocol is not None and protocol >= 4:
        return (f"{filename}: saved in torch's legacy format with pickle protocol {protocol} "
                f"(torch.save(..., _use_new_zipfile_serialization=False, pickle_protocol="
                f"{protocol})), which torch's weights_only=True reader does not read "
                f"({_unpickler_cause(error)}); re-save it with torch.save's defaults")
    if isinstance(error, pickle.UnpicklingError) and "WeightsUnpickler error" in str(error):
        return (f"{filename}: refused by torch's weights_only=True reader "
                f"({_unpickler_cause(error)}), which the plugin never bypasses: a damaged or "
                "crafted file; re-save the checkpoint where it was written")
    size = Path(filename).stat().st_size if Path(filename).exists() else 0
    if Path(filename).is_file() and is_truncated_zip(Path(filename)):  # not torch's
        # paragraph on miniz (T2 #4, session 25): what fairseq-generate said already
        return (f"{filename}: truncated checkpoint ({size} bytes: its end, the zip "
                "directory, is missing)")
    return (f"{filename}: unreadable checkpoint ({size} bytes; truncated or corrupted?): "
            f"{_first_line(error)}")


def _legacy_pickle_protocol(filename: str | Path) -> int | None:
    """The pickle protocol of a legacy-format (non-zip) checkpoint, else None."""
    try:
        if checkpoint_format(filename) != "legacy":
            return None
        with open(filename, "rb") as stream:
            return stream.read(2)[1]
    except (OSError, NotACheckpointError):
        return None


def _unpickler_cause(error: BaseException) -> str:
    """What torch's weights_only unpickler itself said (its message leads with advice to
    load with ``weights_only=False``, which must never be passed on)."""
    text = str(error).split("WeightsUnpickler error:", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:200] if lines else "no reason given"


def describe_schedule_problem(filename: str, error: BaseException, scheduler: str) -> str | None:
    """One line when ``error`` arose in a fairseq learning-rate scheduler's
    ``load_state_dict`` (the checkpoint's run used another ``--lr-scheduler``, e.g. ``fixed``
    has no ``best`` for ``inverse_sqrt``); None for any other failure."""
    inner, frames = _innermost(error), []
    trace = inner.__traceback__
    while trace is not None:
        frames.append(trace.tb_frame)
        trace = trace.tb_next
    if not any(frame.f_code.co_name == "load_state_dict" and str(
            frame.f_globals.get("__name__", "")).startswith("fairseq.optim.lr_scheduler")
            for frame in frames):
        return None
    try:
        cfg = read_checkpoint(filename, "meta").get("cfg")
        saved = config_entry(config_entry(cfg, "lr_scheduler"), "_name")
    except Exception:  # the file was read a moment ago; without its name the line still says
        saved = None
    used = f"--lr-scheduler {saved}" if saved and saved != scheduler else "other settings"
    return (f"{filename}: its learning-rate schedule ({used}) does not load into this run's "
            f"--lr-scheduler {scheduler} ({first_cause(error)}): add --reset-lr-scheduler to "
            f"let {scheduler} take over at the checkpoint's update (weights, optimizer state "
            "and update count are kept)")


def describe_checkpoint_problem(
    filename: str, model_shapes: dict[str, torch.Size], error: BaseException
) -> str:
    """Diagnose a failed load: unreadable file, then shape or key mismatches, else ``error``."""
    try:
        state = read_checkpoint(filename)
        saved = state["model"]
    except Exception as read_error:  # any failure to read means the file is unreadable
        return f"{describe_unreadable(filename, read_error)}; {RESUME_HINT}"
    if not isinstance(saved, dict):
        return f"{filename}: not a fairseq checkpoint (its 'model' is a {type(saved).__name__}, " \
            "not a dict of tensors)"
    problem = describe_shape_mismatch(filename, tensor_shapes(saved), model_shapes)
    if problem:
        return problem
    return f"{filename}: could not be loaded: {first_cause(error)}"


# the nllb branch's data-source tags (tasks.multilingual_config.DATA_SOURCE_PREFIX_TAGS),
# appended to the dictionary by --add-data-source-prefix-tags
DATA_SOURCE_TAGS = 3


def _shape_hint(name: str, saved: tuple[int, ...], model: tuple[int, ...]) -> str:
    """What the shapes themselves say (nothing is guessed): the data-source tags' rows."""
    if "embed_tokens" not in name and "output_projection" not in name:
        return ""
    extra = model[0] - saved[0]
    if saved[1:] == model[1:] and abs(extra) == DATA_SOURCE_TAGS:
        if extra > 0:
            return (f": {DATA_SOURCE_TAGS} more dictionary entries in the model, the "
                    "data-source tags of --add-data-source-prefix-tags, which the "
                    "checkpoint's run did not use: remove that flag")
        return (f": {DATA_SOURCE_TAGS} more dictionary entries in the checkpoint, the "
                "data-source tags its run added with --add-data-source-prefix-tags: add "
                "that flag")
    return ""


def describe_shape_difference(
    filename: str, saved: dict[str, tuple[int, ...]], model_shapes: dict[str, Any]
) -> str | None:
    """One line naming the first parameter the checkpoint and the model both hold in
    different shapes, else None."""
    for name, shape in model_shapes.items():
        if name in saved and tuple(saved[name]) != tuple(shape):
            return (f"{filename}: does not match the model: {name} has shape "
                    f"{list(saved[name])} in the checkpoint and {list(shape)} in the "
                    f"model{_shape_hint(name, tuple(saved[name]), tuple(shape))}")
    return None


def describe_shape_mismatch(
    filename: str, saved: dict[str, tuple[int, ...]], model_shapes: dict[str, Any]
) -> str | None:
    """One line naming the first parameter whose name or shape differs, else None."""
    different = describe_shape_difference(filename, saved, model_shapes)
    if different:
        return different
    missing = sorted(set(model_shapes) - set(saved))
    unexpected = sorted(set(saved) - set(model_shapes))
    if missing or unexpected:
        return (f"{filename}: does not match the model: {len(missing)} missing parameters "
                f"(e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]}); "
                "check --arch and the layer counts")
    return None
