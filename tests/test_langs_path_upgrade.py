"""A checkpoint of an earlier plugin version holds its ``--langs FILE`` as the path, often
relative (``--langs langs.txt``, as docs/nllb.md shows). Loading it from another directory
left the path (the nllb branch's generate: "Removing langs from ensemble components not yet
supported!"), and an export kept it without a word (issue 31 item 1)."""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fairseq_shard_plugin.checkpoint.consolidate import ConsolidateError, export_consolidated
from fairseq_shard_plugin.checkpoint.portable import languages_as_lists
from launching.harness import REPO, run_command

CODES = ["eng_Latn", "fra_Latn", "deu_Latn"]


def _old_checkpoint(path: Path, langs: str, data: str, save_dir: str = "checkpoints") -> Path:
    """A full checkpoint as earlier versions wrote it: ``langs`` the path as given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {"encoder.embed_tokens.weight": torch.ones(8, 4)},
                "cfg": {"task": {"_name": "translation_multi_simple_epoch", "data": data,
                                 "langs": langs, "lang_dict": None},
                        "model": {"_name": "transformer", "langs": langs},
                        "checkpoint": {"save_dir": save_dir}},
                "optimizer_history": [{"num_updates": 3, "optimizer_name": "FairseqAdam",
                                       "lr_scheduler_state": {"best": None}}],
                "extra_state": {"train_iterator": {"epoch": 1}}}, path)
    return path


def _state(langs: str, data: str | None = None, save_dir: str = "checkpoints") -> dict:
    return {"cfg": {"task": {"data": data, "langs": langs, "lang_dict": None},
                    "model": argparse.Namespace(langs=langs, data=data),
                    "checkpoint": {"save_dir": save_dir}}}


def test_a_relative_langs_path_is_read_beside_the_data_or_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """From another working directory the path is tried against the data directories
    (split as fairseq splits them), the checkpoint's directory and the directory the
    training ran in (the checkpoint still in its relative save dir); else one warning."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    data = tmp_path / "data"
    (data / "lists").mkdir(parents=True)
    (data / "lists" / "langs.txt").write_text(",".join(CODES) + "\n")
    (data / "dict.eng_Latn.txt").write_text("")  # binarised data: a data directory
    somewhere = tmp_path / "somewhere" / "checkpoint_last.pt"
    upgraded = languages_as_lists(_state("lists/langs.txt", f"{tmp_path / 'shard0'}:{data}"),
                                  somewhere)
    assert upgraded["cfg"]["task"]["langs"] == CODES == upgraded["cfg"]["model"].langs
    # beside the checkpoint (a copy of the training's file), or in the training's own
    # directory's data: /exp/data for /exp/checkpoints/run/checkpoint_last.pt saved as
    # checkpoints/run with the data directory data
    beside = tmp_path / "export" / "langs.txt"
    beside.parent.mkdir()
    beside.write_text("\n".join(reversed(CODES)))
    assert languages_as_lists(_state("langs.txt"), beside.parent / "checkpoint_last.pt")[
        "cfg"]["task"]["langs"] == CODES[::-1]
    experiment = tmp_path / "exp"
    (experiment / "checkpoints" / "run").mkdir(parents=True)
    (experiment / "data").mkdir()
    (experiment / "data" / "dict.eng_Latn.txt").write_text("")
    (experiment / "data" / "langs.txt").write_text(" ".join(CODES))
    checkpoint = experiment / "checkpoints" / "run" / "checkpoint_last.pt"
    assert languages_as_lists(_state("langs.txt", "data", save_dir="./checkpoints/run"),
                              checkpoint)["cfg"]["model"].langs == CODES
    assert not caplog.records
    # the training's directory itself is not read: a crafted save dir names any ancestor
    (experiment / "langs.txt").write_text(" ".join(CODES))
    with caplog.at_level(logging.WARNING):
        kept = languages_as_lists(_state("langs.txt", save_dir="checkpoints/run"), checkpoint)
    assert kept["cfg"]["task"]["langs"] == "langs.txt" == kept["cfg"]["model"].langs
    (warning,) = [record.getMessage() for record in caplog.records]
    assert warning == (
        f"{checkpoint}: cfg.task.langs holds the path 'langs.txt' of a --langs file (as "
        "earlier plugin versions saved it), not found from the working directory, the "
        "checkpoint's data directories or its own directory; it stays a path, on which the "
        "nllb branch's generate stops: give --model-overrides \"{'langs': [...]}\" with the "
        "training's language list, or run from the directory the path is relative to")


def test_an_export_reads_a_relative_langs_path_or_refuses_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export holds the list (stock fairseq reads no langs file); one whose path cannot
    be read from anywhere is refused, and nothing is written."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "langs.txt").write_text(",".join(CODES))
    (data / "dict.eng_Latn.txt").write_text("")
    source = _old_checkpoint(tmp_path / "exp" / "checkpoints" / "checkpoint_last.pt",
                             "langs.txt", str(data))
    monkeypatch.chdir(tmp_path / "exp" / "checkpoints")
    export = export_consolidated(source, tmp_path / "model.pt")
    cfg = torch.load(export, weights_only=True)["cfg"]
    assert cfg["task"]["langs"] == CODES == cfg["model"]["langs"]
    (data / "langs.txt").unlink()
    with pytest.raises(ConsolidateError) as refused:
        export_consolidated(source, tmp_path / "second.pt")
    assert str(refused.value) == (
        f"{source}: cfg.task.langs holds the path 'langs.txt' of a --langs file (as earlier "
        "plugin versions saved it), not found from the working directory, the checkpoint's "
        "data directories or its own directory; an export keeps no path: run from the "
        "directory the path is relative to (the training's), or copy the file beside the "
        "checkpoint; not exported")
    assert not (tmp_path / "second.pt").exists()


def test_a_checkpoints_langs_path_reads_nothing_outside_the_directories_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The checkpoint names the path and its data directory: a crafted ``../secret/token``
    beside a "data directory" of its choosing copied the token into an export as a
    language code (the second audit). Only the working directory, the checkpoint's, the
    training's and binarised data directories are read, links resolved; one code stored as
    a string (mBART's tasks store ``en_XX``) is no path."""
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "token").write_text("hf_SECRETTOKEN123\n")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    checkpoint = tmp_path / "ckpt" / "checkpoint_last.pt"
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "link").symlink_to(tmp_path / "secret")
    crafted_save_dir = languages_as_lists(  # the training's directory would be /
        {"cfg": {"task": {"langs": str(tmp_path / "secret" / "token"), "data": None},
                 "checkpoint": {"save_dir": str(checkpoint.parent)[1:]}}}, checkpoint,
        warn=False)
    assert crafted_save_dir["cfg"]["task"]["langs"] == str(tmp_path / "secret" / "token")
    for langs, data in (("../secret/token", str(tmp_path / "ckpt")),
                        ("secret/token", str(tmp_path)),  # no dict.*.txt: no data directory
                        ("link/token", None), (str(tmp_path / "secret" / "token"), None)):
        kept = languages_as_lists(_state(langs, data), checkpoint, warn=False)
        assert kept["cfg"]["task"]["langs"] == langs, langs
    with caplog.at_level(logging.WARNING):
        one = languages_as_lists(_state("en_XX"), checkpoint)
    assert one["cfg"]["task"]["langs"] == "en_XX" and not caplog.records


@pytest.mark.e2e  # a fresh process with the plugin's hooks installed
def test_fairseqs_loader_upgrades_a_relative_langs_path_from_another_directory(
    tmp_path: Path
) -> None:
    """fairseq's ``load_checkpoint_to_cpu`` (hook 5, which generation and resumes read
    through) in another working directory: the path read in the training's data."""
    experiment = tmp_path / "exp"
    (experiment / "data").mkdir(parents=True)
    (experiment / "data" / "dict.eng_Latn.txt").write_text("")
    (experiment / "data" / "langs.txt").write_text(",".join(CODES))
    checkpoint = _old_checkpoint(experiment / "checkpoints" / "checkpoint_last.pt",
                                 "langs.txt", "data")
    gone = _old_checkpoint(tmp_path / "moved" / "checkpoint_last.pt", "langs.txt", "data")
    loaded = run_command([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        import fairseq_shard_plugin
        from fairseq import checkpoint_utils
        fairseq_shard_plugin.activate()
        for path in sys.argv[1:]:
            cfg = checkpoint_utils.load_checkpoint_to_cpu(path)["cfg"]
            print("langs:", list(cfg.task.langs) if not isinstance(cfg.task.langs, str)
                  else cfg.task.langs)
        """), str(checkpoint), str(gone)], cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    output = loaded.stdout + loaded.stderr  # (fairseq's logging goes to stdout)
    assert [line for line in output.splitlines() if line.startswith("langs:")] == [
        f"langs: {CODES}", "langs: langs.txt"], output[-3000:]
    assert f"| {gone}: cfg.task.langs holds the path 'langs.txt' of a --langs file" in output
