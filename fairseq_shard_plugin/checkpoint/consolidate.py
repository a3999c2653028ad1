"""``fairseq-shard-consolidate``: a standard fairseq checkpoint for inference.

Reads a training checkpoint of a sharded run (a save dir, meaning its
``checkpoint_last.pt``, or a checkpoint file; full or ``--checkpoint-format sharded``),
drops the optimizer state and writes the full model weights, optionally cast to
fp16/bf16, as an ordinary fairseq checkpoint that ``fairseq-generate --path`` and
``TransformerModel.from_pretrained`` load, stock fairseq's included, without the plugin: its
config is made of plain containers and stock names (``portable``).

:func:`export_consolidated` streams: it reads the checkpoint's pickle only (tensors as
``meta``), then writes each model tensor in turn, read from the full file or from the
chunks of the DCP shards (``stored_tensors``) and cast as it is read, straight into the
output (``streaming_writer``); the optimizer state is never read. Peak memory: the largest
tensor in its output dtype. :func:`read_full_state` instead gathers every tensor,
optimizer state included, for code that needs all of it.
"""

from __future__ import annotations

import logging
import os
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from fairseq_shard_plugin.checkpoint.atomic_files import (
    WriteError,
    describe_os_error,
    write_atomically,
)
from fairseq_shard_plugin.checkpoint.averaging import AveragingError, averaged_model
from fairseq_shard_plugin.checkpoint.errors import describe_unreadable, in_save_dir
from fairseq_shard_plugin.checkpoint.fairscale_sets import (
    METADATA_KEY,
    FairscaleShardsError,
    is_rank_file_state,
    read_rank_file,
)
from fairseq_shard_plugin.checkpoint.fairscale_shards import (
    consolidated_state,
    modules_shared_by_config,
)
from fairseq_shard_plugin.checkpoint.integrity import (
    RESUME_HINT,
    corruption_message,
    damaged_zip_entries,
)
from fairseq_shard_plugin.checkpoint.literal_specs import unsafe_spec
from fairseq_shard_plugin.checkpoint.portable import (
    languages_numbering_the_tokens,
    portable_state,
    stored_language_tokens,
    unread_langs_problem,
)
from fairseq_shard_plugin.checkpoint.reading import (
    NotACheckpointError,
    checkpoint_format,
    read_checkpoint,
)
from fairseq_shard_plugin.checkpoint.safe_loading import allow_fairseq_checkpoint_types
from fairseq_shard_plugin.checkpoint.shard_metadata import SafeFileSystemReader
from fairseq_shard_plugin.checkpoint.sharded import (
    MARKER,
    SHARDED_KEY,
    ShardedCheckpointError,
    fill_tensors,
    full_tensors,
    is_sharded_index,
    read_shard_metadata,
    shard_directory,
    tensor_paths,
)
from fairseq_shard_plugin.checkpoint.stored_tensors import (
    StoredTensorError,
    StreamedTensor,
    check_byte_order,
    check_stored_where_torch_says,
    dcp_tensors,
    record_offsets,
    stored_block,
)
from fairseq_shard_plugin.checkpoint.streaming_writer import (
    LazyTensor,
    ResidentTensor,
    write_checkpoint,
)
from fairseq_shard_plugin.errors import ShardPluginError

logger = logging.getLogger(__name__)

# what an inference checkpoint leaves out of a training checkpoint
_DROPPED = ("last_optimizer_state", SHARDED_KEY, METADATA_KEY)  # (fairscale's flat layout)
_EXPORT_HINT = "export an intact checkpoint instead (fairseq-shard-verify SAVE_DIR lists them)"
# fairseq's names for the checkpoints of a save dir (resume, best, epoch and interval ones)
_TRAINING_NAME = re.compile(r"checkpoint(_last|_best|[0-9]+|_[0-9]+_[0-9]+)\S*\.pt")


class ConsolidateError(ShardPluginError, ValueError):
    """An input that cannot be consolidated; the message names the path and the problem,
    and advises exporting another checkpoint where the checks' own advice is to resume
    from one."""

    def __init__(self, message: str) -> None:
        super().__init__(message.replace(RESUME_HINT, _EXPORT_HINT))


def resolve_checkpoint(source: str | Path) -> Path:
    """A checkpoint file, or a save dir's ``checkpoint_last.pt``."""
    path = Path(source)
    if path.is_dir():
        others = sorted(p.name for p in path.glob("checkpoint_last*.pt") if p.is_file())
        path = path / "checkpoint_last.pt"
        if not path.is_file() and others:  # a --checkpoint-suffix run's, or stock's shards
            raise ConsolidateError(f"{path.parent} holds no checkpoint_last.pt but "
                                   f"{', '.join(others[:3])}: give that file")
    if not path.is_file():
        raise ConsolidateError(f"{path}: no such checkpoint (give a save dir or a .pt file)")
    return path


def _load(path: Path, map_location: str) -> Any:
    """``read_checkpoint`` (``weights_only=True``; a zip file's tensors are mapped, not
    read); a damaged file in one line."""
    allow_fairseq_checkpoint_types()
    try:
        state = read_checkpoint(path, map_location)
    except Exception as error:
        line = describe_unreadable(path, error)
        damaged = any(f"{path}: {kind} checkpoint (" in line for kind in ("truncated",
                                                                        "unreadable"))
        raise ConsolidateError(f"{line}; {_EXPORT_HINT}" if damaged else line) from error
    damaged = [] if is_sharded_index(state) else damaged_zip_entries(path)
    if damaged:
        raise ConsolidateError(corruption_message(path, damaged))
    return state


def _require_fairseq_checkpoint(path: Path, state: Any) -> None:
    """A dict with the model and its config: ``cfg``, or ``args`` before fairseq 0.10."""
    if not isinstance(state, dict) or "model" not in state or (
            "cfg" not in state and "args" not in state):
        raise ConsolidateError(f"{path}: not a fairseq checkpoint (no 'model' and 'cfg', "
                               "nor the 'args' of fairseq before 0.10)")


def read_full_state(path: Path) -> dict[str, Any]:
    """The checkpoint's full state (CPU tensors, optimizer state included; a sharded
    checkpoint's shards gathered in this process), read with ``weights_only=True``."""
    state = _load(path, "cpu")
    if is_sharded_index(state):  # --checkpoint-format sharded: gather the DCP shards
        try:
            tensors = full_tensors(path, state)
        except ShardedCheckpointError as error:
            raise ConsolidateError(str(error)) from error
        state = fill_tensors({k: v for k, v in state.items() if k != SHARDED_KEY}, tensors)
    _require_fairseq_checkpoint(path, state)
    return state


def _with_shards(path: Path, index: dict[str, Any], exported: dict[str, Any],
                 dtype: torch.dtype | None) -> Any:
    """``exported`` (an index's entries) with each reference replaced by the tensor DCP
    stored in chunks, model tensors cast to ``dtype``; without one, 16-bit shards are
    widened to fp32, as a full checkpoint of the same run holds them, so that a run's
    export does not depend on its checkpoint format."""
    read_shard_metadata(path, index)  # the one-line checks, checksums included
    directory = shard_directory(path, index)
    metadata = SafeFileSystemReader(directory).read_metadata()
    tensors = dcp_tensors(directory, metadata, tensor_paths(exported))
    cast = {p: t.cast(dtype or _widened(t.dtype)) if p.startswith("model/") else t
            for p, t in tensors.items()}
    return fill_tensors(exported, cast)


def _widened(dtype: torch.dtype) -> torch.dtype | None:
    """fp32 for a 16-bit floating dtype, else None (kept)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else None


class _TensorsInFile:
    """Meta tensors of a checkpoint file as streamed tensors: a storage seen under several
    names (a tied weight) becomes one, hence is written once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.planned: dict[tuple, StreamedTensor] = {}
        self.offsets: frozenset[int] | None = None

    def __call__(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> LazyTensor:
        block = stored_block(self.path, tensor)
        if self.offsets is None:
            self.offsets = record_offsets(self.path)
        check_stored_where_torch_says(block, self.offsets)
        streamed = StreamedTensor(block.shape, block.dtype, (block,)).cast(dtype)
        return self.planned.setdefault((block, streamed.dtype), streamed)


def _inference_plan(path: Path, state: dict[str, Any], dtype: torch.dtype | None
                    ) -> tuple[Any, _TensorsInFile]:
    """The checkpoint without optimizer state, its model tensors streamed (and cast) from
    the file or its shards; the plan streams any other tensor the state holds."""
    check_byte_order(str(path), path)
    plan = _TensorsInFile(path)
    exported = {key: value for key, value in state.items() if key not in _DROPPED}
    if is_sharded_index(state):
        return _with_shards(path, state, exported, dtype), plan
    exported["model"] = {name: plan(value, dtype) if isinstance(value, torch.Tensor) else value
                         for name, value in state["model"].items()}
    return exported, plan


def _legacy_inference_state(path: Path, dtype: torch.dtype | None) -> dict[str, Any]:
    """A legacy-format (one pickle stream) checkpoint without optimizer state, read whole:
    that format has no records to stream from; such files predate torch 1.6 or were saved
    with ``_use_new_zipfile_serialization=False``."""
    state = _load(path, "cpu")
    _require_fairseq_checkpoint(path, state)
    return _resident_inference_state(state, dtype)


def _rank_files_inference_state(path: Path, dtype: torch.dtype | None) -> dict[str, Any]:
    """Stock ``fully_sharded``'s per-rank files (``NAME-shard0.pt``, ...; any one of them
    names the set; ``path`` already CRC-checked) put together in memory: each holds slices
    of flat parameters, so there is no whole tensor to stream."""
    try:
        state = read_rank_file(path, check_crc=False)
        state = consolidated_state(str(path), state, read_rank_file, None, None,
                                   modules_shared_by_config(state))
    except FairscaleShardsError as error:
        raise ConsolidateError(str(error)) from error
    return _resident_inference_state(state, dtype)


def _resident_inference_state(state: dict[str, Any], dtype: torch.dtype | None
                              ) -> dict[str, Any]:
    """``state`` in memory without optimizer state, its model tensors cast to ``dtype``."""
    exported = {key: value for key, value in state.items() if key not in _DROPPED}
    cast: dict[int, torch.Tensor] = {}  # a tied weight's names keep one tensor

    def as_exported(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or dtype is None \
                or not value.is_floating_point():
            return value
        if id(value) not in cast:
            cast[id(value)] = value.to(dtype)
        return cast[id(value)]

    exported["model"] = {name: as_exported(value) for name, value in state["model"].items()}
    return exported


def stock_fairseq_notes(exported: dict[str, Any]) -> list[str]:
    """What stock fairseq needs told to use the export ``exported``: a model trained with
    the nllb branch's data-source tags has 3 dictionary rows that stock fairseq 0.12 does
    not add (its generate fails on the embedding's shape)."""
    cfg = exported.get("cfg")
    task = cfg.get("task") if isinstance(cfg, dict) else None
    if isinstance(task, dict) and task.get("add_data_source_prefix_tags"):
        return ["this model was trained with --add-data-source-prefix-tags: its dictionary "
                "has 3 more rows than stock fairseq 0.12 builds, so generate with the plugin "
                "(--user-dir fairseq_shard_plugin --task sharded_translation_multi_simple_"
                "epoch --add-data-source-prefix-tags) or with fairseq's nllb branch"]
    languages = languages_numbering_the_tokens(exported)
    if not languages:
        return []
    flags = ["--task translation_multi_simple_epoch", f"--langs {','.join(languages)}"]
    encoder, decoder = stored_language_tokens(exported) or (None, False)
    flags += [f"--encoder-langtok {encoder}"] * bool(encoder) + ["--decoder-langtok"] * decoder
    if isinstance(task, dict) and task.get("lang_tok_replacing_bos_eos"):
        flags.append("--lang-tok-replacing-bos-eos")
    return [f"stock fairseq-generate translates this multilingual model as trained only with "
            f"its language settings, {' '.join(flags)} (and --lang-pairs SRC-TGT --source-lang "
            "SRC --target-lang TGT): without them it numbers the languages otherwise and "
            "writes other languages, silently"]


def holds_training_state(path: Path) -> bool:
    """Whether the readable checkpoint at ``path`` is one to resume from (optimizer state,
    or a sharded index); False for anything else, unreadable files included."""
    try:
        state = read_checkpoint(path, "meta")
    except Exception:
        return False
    return isinstance(state, dict) and ("last_optimizer_state" in state
                                        or is_sharded_index(state))


# torch.save's legacy format starts with its magic number, pickled (protocol 2, LONG1)
_LEGACY_TORCH_HEAD = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


def _replaceable(path: Path) -> bool:
    """Whether an existing file may be replaced by an export: empty, or written by
    ``torch.save`` (a zip holding its ``data.pkl``, or the legacy format's magic number);
    not any other zip (``.npz``) or pickle."""
    try:
        if path.stat().st_size == 0:
            return True
        if checkpoint_format(path) == "zip":
            with zipfile.ZipFile(path) as archive:
                return any(name.endswith("/data.pkl") or name == "data.pkl"
                           for name in archive.namelist())
        with open(path, "rb") as stream:
            return stream.read(len(_LEGACY_TORCH_HEAD)) == _LEGACY_TORCH_HEAD
    except (NotACheckpointError, OSError, zipfile.BadZipFile):
        return False


def _special_file(path: Path) -> str | None:
    """What ``path`` (or the file it links to) is when it exists and is neither a regular
    file nor a directory: an export renamed over ``/dev/null`` replaced the device."""
    for kind, test in (("a character device", path.is_char_device),
                       ("a block device", path.is_block_device), ("a FIFO", path.is_fifo),
                       ("a socket", path.is_socket)):
        if test():
            return kind
    return None


def _inside_a_shard_directory(destination: Path) -> Path | None:
    """The shard directory (one holding the plugin's marker) ``destination`` lies in."""
    folder = destination.parent.resolve()
    return next((each for each in (folder, *folder.parents) if (each / MARKER).exists()),
                None)


def export_target_problem(destination: str | Path, source: Path | None = None,
                          save_dir: str | Path | None = None) -> str | None:
    """Why an export must not be written to ``destination``, or None: it would replace the
    checkpoint it is read from (``source``), another training checkpoint, a file of a
    sharded checkpoint's shard directory or a file that is not a checkpoint, or take a name
    fairseq resumes from (``checkpoint_last.pt``), or any of fairseq's checkpoint names in
    the training's ``save_dir``: a resume would then restart at update 0 from weights
    without optimizer state and overwrite the save dir's checkpoints; or a destination that
    names a directory (``out/``, ``out/.``), which ``Path`` would read as a file ``out``."""
    if os.path.basename(str(destination)) in ("", ".", ".."):
        return "it names a directory (it ends with a separator, . or ..)"
    destination = Path(destination)
    shards = _inside_a_shard_directory(destination)
    if shards is not None:
        return (f"it is inside {shards}, where a sharded checkpoint keeps its shards "
                "(replacing a file there damages it)")
    special = _special_file(destination)
    if special:
        return f"it is {special}, which the export would replace with a file"
    if destination.is_dir():
        return "it is a directory: name a file in it (e.g. model.pt there)"
    if destination.is_symlink() or destination.is_file():
        if source is not None and destination.exists() and os.path.samefile(destination,
                                                                            source):
            return f"it is the checkpoint being exported ({source})"
        if holds_training_state(destination):
            return "it holds a training checkpoint (optimizer state), which it would replace"
        if destination.is_file() and not _replaceable(destination):
            return "it is an existing file that is not a checkpoint, which it would replace"
    if re.fullmatch(r"checkpoint_last\S*\.pt", destination.name):
        return "fairseq resumes training from checkpoint_last*.pt"
    if save_dir is not None and _TRAINING_NAME.fullmatch(destination.name) \
            and in_save_dir(str(destination), str(save_dir)):
        return f"{destination.name} is one of the training's own checkpoint names in {save_dir}"
    return None


class _Unchanged:
    """The identity of a file when it was first read, to tell whether it was replaced (a
    training's save renames a new file over ``checkpoint_last.pt``) or removed (its
    ``--keep-interval-updates``) while being exported: its tensors would then be read from
    another file at the first one's offsets, or its shards be gone with it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.identity = self._identity()

    def _identity(self) -> tuple[int, ...] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns

    def changed(self) -> bool:
        return self.identity is None or self._identity() != self.identity

    def error(self) -> ConsolidateError:
        """The one-line error that says what happened to the file."""
        happened = "replaced" if self.path.exists() else "removed"
        return ConsolidateError(
            f"{self.path} was {happened} while it was read (a training saving into its "
            "save dir?): nothing was written; run the export again, or export a checkpoint "
            "the training no longer writes or removes (e.g. a copy such as "
            "checkpoint_last.pt.bak beside it)")

    def check(self) -> None:
        if self.changed():
            raise self.error()

    def explain(self, error: Exception) -> ConsolidateError:
        """``error``, a failure to read the file or its shards, in one line: the file's
        replacement or removal when that happened meanwhile (a training's cleanup then
        deletes its shards, so the failure is a consequence)."""
        if self.changed():
            return self.error()
        if isinstance(error, OSError):
            return ConsolidateError(f"{self.path}: could not be read: "
                                    f"{describe_os_error(error)}")
        return ConsolidateError(str(error))


def _export_plan(path: Path, dtype: torch.dtype | None) -> tuple[Any, Any]:
    """The inference state of the checkpoint ``path`` and the plan that writes its
    tensors, whatever its format."""
    try:
        legacy = checkpoint_format(path) == "legacy"
    except NotACheckpointError as error:
        raise ConsolidateError(f"{path}: {error}") from error
    if legacy:
        return _legacy_inference_state(path, dtype), ResidentTensor
    state = _load(path, "meta")  # the pickle only: tensors on the meta device
    _require_fairseq_checkpoint(path, state)
    if is_rank_file_state(state):
        return _rank_files_inference_state(path, dtype), ResidentTensor
    return _inference_plan(path, state, dtype)


def export_consolidated(
    source: str | Path, destination: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Write the inference checkpoint of ``source`` to ``destination`` (atomically), one
    tensor at a time; refused where :func:`export_target_problem` says so."""
    return export_checkpoints([source], destination, dtype)


def export_checkpoints(
    sources: list[str | Path], destination: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """:func:`export_consolidated` of one source, or of the mean of several sources'
    weights (:mod:`.averaging`), with the first one's config."""
    paths = [resolve_checkpoint(source) for source in sources]
    problems = [export_target_problem(destination, source=path, save_dir=path.parent)
                for path in paths]  # a source's folder is a save dir: its names refused
    if len(paths) > 1 and os.path.lexists(destination):
        problems.append("it exists, and the last path given is the output (an input's name "
                        "there would be replaced by the average): remove it first")
    for problem in problems:
        if problem:
            raise ConsolidateError(f"refusing to write the export to {destination}: "
                                   f"{problem}; name another file (e.g. model.pt)")
    for index, path in enumerate(paths):
        if any(os.path.samefile(path, earlier) for earlier in paths[:index]):
            logger.warning(f"{path} is given twice (or under two names): it counts twice in "
                           "the average, as fairseq's average_checkpoints would count it")
    watched = [_Unchanged(path) for path in paths]
    plans = []
    for watch in watched:
        try:
            plans.append(_export_plan(watch.path, dtype if len(paths) == 1 else None))
        except Exception as error:
            if not isinstance(error, (ShardPluginError, OSError)) and not watch.changed():
                raise  # neither a problem of the checkpoint nor a training's save: a bug
            raise watch.explain(error) from error
    exported, plan = plans[0]
    if len(plans) > 1:
        try:
            model = averaged_model(paths, [state["model"] for state, _ in plans], dtype)
        except AveragingError as error:
            raise ConsolidateError(str(error)) from None
        exported = dict(exported, model=model)
    exported = portable_state(exported, paths[0])
    langs_problem = unread_langs_problem(exported)
    if langs_problem:  # stock fairseq and the nllb branch need the list, not a path
        raise ConsolidateError(f"{paths[0]}: {langs_problem}; an export keeps no path: run "
                               "from the directory the path is relative to (the training's), "
                               "or copy the file beside the checkpoint; not exported")
    unsafe = unsafe_spec(exported)
    if unsafe:  # stock fairseq loads plain configs: the export would carry the code to it
        raise ConsolidateError(f"{paths[0]}: {unsafe}; not exported")
    for note in stock_fairseq_notes(exported):
        logger.warning(note)
    destination = Path(destination)
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        in_the_way = next((folder for folder in (destination.parent, *destination.parent.parents)
                           if folder.exists() and not folder.is_dir()), None)
        if in_the_way is not None:  # "File exists" said what, not where or why
            raise WriteError(f"could not write {destination}: {in_the_way} is a file, not a "
                             "directory; give another path or move that file") from error
        raise WriteError(f"could not create the directory {destination.parent}: "
                         f"{describe_os_error(error)}") from error
    try:
        def write(out: Any) -> None:
            write_checkpoint(out, exported, plan)
            for watch in watched:
                watch.check()  # before the export takes its name

        write_atomically(destination, write)
    except StoredTensorError as error:
        changed = next((watch for watch in watched if watch.changed()), watched[0])
        raise changed.explain(error) from None
    return destination
