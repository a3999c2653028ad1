"""An export (``fairseq-shard-consolidate``, ``--export-consolidated``) never takes the place of
training state: not the checkpoint it reads, not another training checkpoint, not a name
fairseq resumes from; a source replaced while it is read writes nothing; and verify says an
export is not a checkpoint to resume from, so ``--newest`` never picks one."""

from __future__ import annotations

import argparse
import os
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fairseq_shard_plugin.checkpoint import consolidate, verify
from fairseq_shard_plugin.cli import verify as cli_verify


def _training_checkpoint(path: Path, updates: int, seed: int = 0) -> Path:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(8, 4, generator=generator)
    torch.save({"model": {"encoder.embed_tokens.weight": weight,
                          "encoder.layers.0.fc1.weight": torch.randn(6, 4, generator=generator)},
                "cfg": {"model": {"_name": "transformer"}},
                "optimizer_history": [{"num_updates": updates}],
                "extra_state": {"train_iterator": {"epoch": 1}},
                "last_optimizer_state": {"state": {0: {"exp_avg": torch.zeros(8, 4)}}}}, path)
    return path


@pytest.fixture
def save_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "save"
    directory.mkdir()
    _training_checkpoint(directory / "checkpoint_1_4.pt", 4)
    shutil.copy(directory / "checkpoint_1_4.pt", directory / "checkpoint_last.pt")
    return directory


@pytest.mark.parametrize(("output", "problem"), [
    ("checkpoint_last.pt", "it is the checkpoint being exported"),
    ("checkpoint_1_4.pt", "it holds a training checkpoint (optimizer state)"),
    ("../elsewhere/checkpoint_last.pt", "fairseq resumes training from checkpoint_last*.pt"),
    # new names of fairseq's kinds beside the source: its --keep-* pruning would count them
    ("checkpoint_30_600.pt", "checkpoint_30_600.pt is one of the training's own checkpoint "
     "names in"),
    ("checkpoint77.pt", "checkpoint77.pt is one of the training's own checkpoint names in"),
    ("fifo", "it is a FIFO, which the export would replace with a file"),
    ("link_to_fifo", "it is a FIFO, which the export would replace with a file"),
])
def test_an_export_never_replaces_training_state(save_dir: Path, output: str,
                                                 problem: str) -> None:
    """An export as root to /dev/null replaced the device with a file (inferT #1)."""
    if output in ("fifo", "link_to_fifo"):
        os.mkfifo(save_dir.parent / "fifo")
        (save_dir / "link_to_fifo").symlink_to(save_dir.parent / "fifo")
        output = "../fifo" if output == "fifo" else output
    before = {p.name: p.read_bytes() if p.is_file() else None for p in save_dir.iterdir()}
    with pytest.raises(consolidate.ConsolidateError, match=(
            f"refusing to write the export to {save_dir / output}: {problem}").replace(
                "(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        consolidate.export_consolidated(save_dir, save_dir / output)
    assert {p.name: p.read_bytes() if p.is_file() else None
            for p in save_dir.iterdir()} == before
    assert not (save_dir.parent / "elsewhere").exists()
    assert not (save_dir.parent / "fifo").exists() or (save_dir.parent / "fifo").is_fifo()


def test_an_export_never_replaces_a_shard_file_or_a_file_that_is_not_a_checkpoint(
    tmp_path: Path
) -> None:
    """The shard directory of the checkpoint being exported (its .distcp files, .metadata,
    the plugin's marker) was writable by an export, which damaged every checkpoint sharing
    it; any other existing file (the data's dictionary, say) was replaced silently."""
    from fairseq_shard_plugin.checkpoint.sharded import MARKER, save_sharded

    save_dir = tmp_path / "save"
    save_dir.mkdir()
    state = torch.load(_training_checkpoint(tmp_path / "full.pt", 4), weights_only=True)
    torch.save(save_sharded(state, save_dir, num_updates=4), save_dir / "checkpoint_last.pt")
    (shards,) = (save_dir / "checkpoint_shards").iterdir()
    dictionary = tmp_path / "dict.src.txt"
    dictionary.write_text("a 1\n")
    arrays = tmp_path / "arrays.npz"  # a zip, and a pickle: neither written by torch.save
    np.savez(arrays, counts=np.arange(3))
    pickled = tmp_path / "meters.pkl"
    pickled.write_bytes(pickle.dumps({"bleu": 1.0}, protocol=2))
    targets = {**{path: "where a sharded checkpoint keeps its shards" for path in (
        *shards.iterdir(), shards / "new.pt")},
        **{path: "it is an existing file that is not a checkpoint" for path in (
            dictionary, arrays, pickled)}}
    assert shards / MARKER in targets and len(targets) > 5
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    for target, problem in targets.items():
        with pytest.raises(consolidate.ConsolidateError, match=problem):
            consolidate.export_consolidated(save_dir, target)
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == before
    consolidate.export_consolidated(save_dir, tmp_path / "model.pt")
    consolidate.export_consolidated(save_dir, tmp_path / "model.pt")  # an export: replaced
    (tmp_path / "empty.pt").touch()  # mktemp's: nothing to lose
    consolidate.export_consolidated(save_dir, tmp_path / "empty.pt")
    # a directory of that name elsewhere is only a name; checkpoint_shards/ itself too
    consolidate.export_consolidated(save_dir, tmp_path / "checkpoint_shards" / "run" / "m.pt")
    consolidate.export_consolidated(save_dir, save_dir / "checkpoint_shards" / "model.pt")
    for named in ("new/", "new/."):  # a directory: it wrote a file named new
        with pytest.raises(consolidate.ConsolidateError, match=r"it names a directory \(it "
                           r"ends with a separator, \. or \.\.\)"):
            consolidate.export_consolidated(save_dir, f"{tmp_path}/{named}")
    assert not (tmp_path / "new").exists()


def test_a_source_replaced_while_it_is_read_writes_nothing(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A training renames its next save over checkpoint_last.pt in the middle of the export:
    the tensors would come from the new file at the old one's offsets."""
    newer = _training_checkpoint(save_dir / "checkpoint_1_8.pt", 8, seed=1)
    write = consolidate.write_checkpoint

    def save_during_the_export(*args: object) -> None:
        shutil.copy(newer, save_dir / ".next")
        os.replace(save_dir / ".next", save_dir / "checkpoint_last.pt")
        write(*args)

    monkeypatch.setattr(consolidate, "write_checkpoint", save_during_the_export)
    out = save_dir.parent / "out"
    with pytest.raises(consolidate.ConsolidateError, match="checkpoint_last.pt was replaced "
                       "while it was read .*: nothing was written; run the export again"):
        consolidate.export_consolidated(save_dir, out / "model.pt")
    assert list(out.iterdir()) == []  # no export, no temporary file


def test_verify_calls_an_export_intact_but_not_resumable_and_newest_skips_it(
    save_dir: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """An export of the newest update sits beside the training checkpoints (same update
    count, a name that sorts last): --newest still names a training checkpoint."""
    export = consolidate.export_consolidated(save_dir, save_dir / "zz_model.pt")
    verdict = verify.check(export)
    assert verdict.intact and not verdict.resumable
    assert verdict.line == (f"{export}: ok (full, update 4; no optimizer state: an "
                            "export for inference, not a checkpoint to resume from)")
    assert verify.check(save_dir / "checkpoint_1_4.pt").resumable
    cli_verify.main(["--newest", str(save_dir)])
    assert capsys.readouterr().out.strip() == str(save_dir / "checkpoint_last.pt")
    for name in ("checkpoint_1_4.pt", "checkpoint_last.pt"):
        (save_dir / name).unlink()
    with pytest.raises(SystemExit, match="no intact checkpoint with optimizer state among 1"):
        cli_verify.main(["--newest", str(save_dir)])


def test_an_export_carries_weights_not_its_sources_place_in_the_training(
    tmp_path: Path
) -> None:
    """Stock ``--restore-file export.pt`` restarted at update 0 yet skipped the batches its
    source had trained on in that epoch, and kept its best score (T2 #2, session 25)."""
    from fairseq import checkpoint_utils

    source = _training_checkpoint(tmp_path / "checkpoint_3_40.pt", 40)
    state = torch.load(source, weights_only=True)
    state["extra_state"] = {"train_iterator": {"version": 2, "epoch": 3, "shuffle": True,
                                               "iterations_in_epoch": 10},
                            "best": 4.2, "val_loss": 4.2, "previous_training_time": 99.0,
                            "metrics": {}, "a task's own entry": [1]}
    state["optimizer_history"] = [{"criterion_name": "CrossEntropyCriterion",
                                   "optimizer_name": "FairseqAdam", "num_updates": 40,
                                   "lr_scheduler_state": {"best": 4.2}}]
    state["cfg"] = {"model": {"_name": "transformer"}, "task": {"_name": "translation"}}
    torch.save(state, source)
    export = consolidate.export_consolidated(source, tmp_path / "model.pt")
    loaded = checkpoint_utils.load_checkpoint_to_cpu(str(export))  # as stock reads it
    assert loaded["extra_state"] == {
        "train_iterator": {"version": 2, "epoch": 1, "iterations_in_epoch": 0},
        "a task's own entry": [1]}
    assert loaded["optimizer_history"][-1]["num_updates"] == 40  # which update's weights


def test_a_resume_from_a_file_without_optimizer_state_is_refused_unless_reset(
    save_dir: Path,
) -> None:
    """Stock fairseq would load the weights, restart the update count at 0 and then save
    over the checkpoints of updates 1, 2, ...; a fine-tune (optimizer reset) is fine."""
    from fairseq_shard_plugin.checkpoint.errors import CheckpointLoadError
    from fairseq_shard_plugin.training.data_position import record_ranks
    from fairseq_shard_plugin.training.trainer_files import trainer_state_loader

    export = consolidate.export_consolidated(save_dir, save_dir.parent / "model.pt")
    state = torch.load(export, weights_only=True)
    with pytest.raises(CheckpointLoadError, match=(
            f"{export}: holds no optimizer state .*: to train from its weights, give "
            f"--finetune-from-model {export} \\(or --reset-optimizer\\)")) as refused:
        trainer_state_loader(None, False, record_ranks)(str(export), state)
    assert "\n" not in str(refused.value)
    assert trainer_state_loader(None, True, record_ranks)(str(export), state) is state


def test_a_damaged_source_is_named_with_advice_for_an_export_not_a_resume(
    save_dir: Path, tmp_path: Path,
) -> None:
    source = save_dir / "checkpoint_1_4.pt"
    data = bytearray(source.read_bytes())
    weight = torch.load(source, weights_only=True)["model"]["encoder.embed_tokens.weight"]
    data[data.index(weight.numpy().tobytes()) + 5] ^= 0xFF  # inside its stored bytes
    source.write_bytes(bytes(data))
    with pytest.raises(consolidate.ConsolidateError) as refused:
        consolidate.export_consolidated(source, tmp_path / "model.pt")
    message = str(refused.value)
    assert "fails its CRC-32 check" in message, message
    assert message.endswith("export an intact checkpoint instead (fairseq-shard-verify "
                            "SAVE_DIR lists them)") and "--restore-file" not in message


def test_an_export_of_a_model_with_data_source_tags_says_how_to_generate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Stock fairseq 0.12 cannot build its dictionary (3 rows short): the export says so."""
    source = _training_checkpoint(tmp_path / "checkpoint_1_4.pt", 4)
    state = torch.load(source, weights_only=True)
    state["cfg"]["task"] = {"_name": "sharded_translation_multi_simple_epoch",
                            "add_data_source_prefix_tags": True}
    torch.save(state, source)
    with caplog.at_level("WARNING"):
        consolidate.export_consolidated(source, tmp_path / "model.pt")
    assert [record.getMessage() for record in caplog.records] == [
        "this model was trained with --add-data-source-prefix-tags: its dictionary has 3 more "
        "rows than stock fairseq 0.12 builds, so generate with the plugin (--user-dir "
        "fairseq_shard_plugin --task sharded_translation_multi_simple_epoch "
        "--add-data-source-prefix-tags) or with fairseq's nllb branch"]
    state["cfg"]["task"]["add_data_source_prefix_tags"] = False  # none without the tags
    torch.save(state, source)
    caplog.clear()
    with caplog.at_level("WARNING"):
        consolidate.export_consolidated(source, tmp_path / "plain.pt")
    assert caplog.records == []


def test_a_save_dir_of_a_checkpoint_suffix_run_names_its_last_checkpoint(
    save_dir: Path
) -> None:
    """--checkpoint-suffix -a writes checkpoint_last-a.pt: the save dir alone used to say
    "give a save dir", which it was."""
    (save_dir / "checkpoint_last.pt").rename(save_dir / "checkpoint_last-a.pt")
    with pytest.raises(consolidate.ConsolidateError, match=(
            f"^{save_dir} holds no checkpoint_last.pt but checkpoint_last-a.pt: give that "
            "file$")):
        consolidate.resolve_checkpoint(save_dir)
    assert consolidate.resolve_checkpoint(save_dir / "checkpoint_last-a.pt").is_file()


def test_a_checkpoint_of_fairseq_before_0_10_exports_with_its_args_as_the_config(
    tmp_path: Path, corpus: Path
) -> None:
    """Its config is an argparse Namespace under 'args' (no 'cfg'): verify and a resume took
    it, the export refused it as "not a fairseq checkpoint"."""
    from fairseq import options

    from fairseq_shard_plugin.checkpoint.safe_loading import allow_fairseq_checkpoint_types

    allow_fairseq_checkpoint_types()
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(corpus), "--arch", "transformer", "--optimizer", "adam"])
    state = torch.load(_training_checkpoint(tmp_path / "new.pt", 4), weights_only=True)
    del state["cfg"]
    (tmp_path / "old").mkdir()
    torch.save({**state, "args": args}, tmp_path / "old" / "checkpoint_last.pt")
    out = consolidate.export_consolidated(tmp_path / "old", tmp_path / "model.pt")
    exported = torch.load(out, weights_only=True)
    assert exported["cfg"]["model"]["arch"] == "transformer"
    assert torch.equal(exported["model"]["encoder.embed_tokens.weight"],
                       state["model"]["encoder.embed_tokens.weight"])


def _model_file(path: Path, model: dict) -> Path:
    torch.save({"model": model, "cfg": {"model": {"_name": "transformer"}},
                "optimizer_history": [{"num_updates": 1}]}, path)
    return path


def test_an_average_follows_each_sources_ties_and_refuses_other_kinds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first source's ties were applied to every source: a second source with untied
    embeddings lost its other names' values (attackA #3); a bool buffer or an integer
    tensor against a float one ended in a traceback (#5); a file given twice counted
    twice without a word (#6)."""
    shared = torch.ones(4, 2)
    tied = _model_file(tmp_path / "tied.pt", {"embed": shared, "projection": shared,
                                              "mask": torch.tensor([True, False])})
    untied = _model_file(tmp_path / "untied.pt", {
        "embed": torch.full((4, 2), 3.0), "projection": torch.full((4, 2), 5.0),
        "mask": torch.tensor([True, False])})
    out = consolidate.export_checkpoints([tied, untied], tmp_path / "mean.pt")
    model = torch.load(out, weights_only=True)["model"]
    assert torch.equal(model["embed"], torch.full((4, 2), 2.0))
    assert torch.equal(model["projection"], torch.full((4, 2), 3.0))
    assert torch.equal(model["mask"], torch.tensor([True, False]))
    both_tied = consolidate.export_checkpoints([tied, tied], tmp_path / "twice.pt")
    model = torch.load(both_tied, weights_only=True)["model"]
    assert model["embed"].untyped_storage().data_ptr() == \
        model["projection"].untyped_storage().data_ptr()  # tied in every source: once
    assert f"{tied} is given twice (or under two names): it counts twice" in caplog.text
    counts = _model_file(tmp_path / "counts.pt", {"embed": torch.ones(4, 2, dtype=torch.long),
                                                  "projection": shared, "mask": shared[0]})
    with pytest.raises(consolidate.ConsolidateError, match=re.escape(
            f"cannot average {tied} and {counts}: embed is floating point in the first and "
            "integer in the other (another model)")):
        consolidate.export_checkpoints([tied, counts], tmp_path / "bad.pt")
    assert not (tmp_path / "bad.pt").exists()


def test_an_export_target_that_is_a_directory_or_reached_through_a_link_is_checked(
    save_dir: Path, tmp_path: Path
) -> None:
    """An existing directory was "remove it first"; a link into the save dir followed by
    .. wrote one of fairseq's checkpoint names there (attackA #4, #8)."""
    (tmp_path / "out").mkdir()
    with pytest.raises(consolidate.ConsolidateError, match="it is a directory: name a file"):
        consolidate.export_consolidated(save_dir, tmp_path / "out")
    inside = save_dir / "inner"
    inside.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "link").symlink_to(inside)
    target = tmp_path / "elsewhere" / "link" / ".." / "checkpoint78.pt"
    with pytest.raises(consolidate.ConsolidateError, match="checkpoint78.pt is one of the "
                       "training's own checkpoint names"):
        consolidate.export_consolidated(save_dir / "checkpoint_last.pt", target)
    assert not (save_dir / "checkpoint78.pt").exists()


@pytest.mark.parametrize("config", ["cfg", "legacy args"])
def test_a_layer_spec_stock_fairseq_would_run_is_neither_exported_nor_called_ok(
    tmp_path: Path, config: str
) -> None:
    """fconv's layer specs reach fairseq's ``eval``: a crafted one was carried into an export,
    whose plain config stock fairseq-generate loads and runs (T2 #1, session 25); stock
    refuses the legacy Namespace form by itself, so the export laundered it."""
    crafted = "[(64, 3)] * (1 + 0 * __import__('os').system('touch marker'))"
    checkpoints = {}
    for name, spec in (("crafted", crafted), ("plain", "[(64, 3)] * 2 + [(64, 1)]")):
        state = torch.load(_training_checkpoint(tmp_path / f"{name}.pt", 4), weights_only=True)
        model = {"_name": "fconv", "arch": "fconv", "encoder_layers": spec,
                 "decoder_layers": "[(64, 3)] * 2", "decoder_attention": "True"}
        del state["last_optimizer_state"]
        if config == "cfg":
            state["cfg"] = {"model": model}
        else:
            del state["cfg"]
            state["args"] = argparse.Namespace(task="translation", **model)
        torch.save(state, tmp_path / f"{name}.pt")
        checkpoints[name] = tmp_path / f"{name}.pt"
    said = ("the model config's layer spec \"[(64, 3)] * (1 + 0 * __import__('os')"
            ".system('touch marker'))\" holds call syntax: only literals joined by + and * "
            "are evaluated (a crafted checkpoint?); stock fairseq would run it as code when "
            "it builds the model")
    verdict = verify.check(checkpoints["crafted"])
    assert not verdict.intact
    assert verdict.line == f"{checkpoints['crafted']}: not a usable fairseq checkpoint ({said})"
    with pytest.raises(consolidate.ConsolidateError) as refused:
        consolidate.export_consolidated(checkpoints["crafted"], tmp_path / "model.pt")
    assert str(refused.value) == f"{checkpoints['crafted']}: {said}; not exported"
    with pytest.raises(consolidate.ConsolidateError):  # the average takes the first's config
        consolidate.export_checkpoints([checkpoints["crafted"], checkpoints["plain"]],
                                       tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists()
    assert verify.check(checkpoints["plain"]).intact
    exported = torch.load(consolidate.export_consolidated(checkpoints["plain"],
                                                          tmp_path / "model.pt"),
                          weights_only=True)
    assert exported["cfg"]["model"]["encoder_layers"] == "[(64, 3)] * 2 + [(64, 1)]"


def test_a_config_that_is_no_mapping_is_called_unusable(tmp_path: Path) -> None:
    """A whole cfg crafted as an argparse Namespace: verify called it ok, consolidate took
    it, and the plugin's own generate ended in omegaconf's traceback (T2 #3, session 25)."""
    path = _training_checkpoint(tmp_path / "checkpoint_1_4.pt", 4)
    state = torch.load(path, weights_only=True)
    torch.save({**state, "cfg": argparse.Namespace(model=argparse.Namespace())}, path)
    verdict = verify.check(path)
    assert not verdict.intact
    assert verdict.line == (f"{path}: not a usable fairseq checkpoint (its cfg is a "
                            "Namespace, not a config mapping)")
