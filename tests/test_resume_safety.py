"""A resume is exact whatever happens to the checkpoint file afterwards, under every backend.

fairseq's own scenario (its ``tests/test_reproducibility.py``): train 3 epochs; separately,
take ``checkpoint1.pt`` as ``checkpoint_last.pt`` and run the same command again. The
resumed run must end exactly where the uninterrupted one did. Under a stock backend with
the plugin active it used to end in NaN: the loaded optimizer state stayed mapped from
``checkpoint_last.pt``, which fairseq then rewrote in place at the next save.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from launching.harness import (
    PLUGIN_DIR,
    REPO,
    in_threads,
    parse_logs,
    rank_environment,
    result_of,
    run_command,
    run_helper,
    tool,
    training_args,
)

from tiny_training import TINY

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)

BACKENDS = ("legacy_ddp", "fully_sharded")
REWRITE_HELPER = REPO / "tests" / "helpers" / "rewrite_after_load.py"
# the epoch summary's figures that must agree exactly (not its timings)
COMPARED = ("train_loss", "train_nll_loss", "train_ppl", "train_gnorm", "train_num_updates",
            "train_lr")


def _args(corpus: Path, save_dir: Path, backend: str) -> list[str]:
    return [*training_args(corpus, save_dir, max_update=0, max_tokens=4096), *TINY,
            "--max-epoch", "3", "--user-dir", str(PLUGIN_DIR),
            "--task", "sharded_translation", "--ddp-backend", backend]


def _train(corpus: Path, save_dir: Path, backend: str) -> dict:
    """One fairseq-train process (as a user starts it); its last epoch summary."""
    done = run_command([tool("fairseq-train"), *_args(corpus, save_dir, backend)],
                       env=rank_environment(), timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return parse_logs(done.stdout + done.stderr)["train"][-1]


@pytest.fixture(scope="module")
def runs(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Per backend: the uninterrupted run, then the run resumed from its checkpoint1.pt."""
    work = tmp_path_factory.mktemp("resume_safety")
    full = in_threads({b: (lambda b=b: _train(corpus, work / b / "full", b)) for b in BACKENDS})
    resumed = {}
    for backend in BACKENDS:
        result_of(full, backend)
        again = work / backend / "resumed"
        again.mkdir()
        shutil.copyfile(work / backend / "full" / "checkpoint1.pt", again / "checkpoint_last.pt")
        # a second name for the file resumed from, outside the save dir: it keeps what it
        # held, and its inode, unless the resume's saves wrote into it in place
        os.link(again / "checkpoint_last.pt", work / backend / "resumed_from.pt")
        resumed[backend] = lambda b=backend, d=again: _train(corpus, d, b)
    resumed = in_threads(resumed)
    return {"work": work, "full": full, "resumed": resumed}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_resumed_from_checkpoint1_ends_exactly_as_the_uninterrupted_one(
    runs: dict, backend: str,
) -> None:
    full, resumed = result_of(runs["full"], backend), result_of(runs["resumed"], backend)
    assert {k: full[k] for k in COMPARED} == {k: resumed[k] for k in COMPARED}
    work = runs["work"] / backend
    final = [torch.load(work / run / "checkpoint_last.pt", weights_only=True)["model"]
             for run in ("full", "resumed")]
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][name], final[1][name]) for name in final[0])
    # the resume's saves replaced checkpoint_last.pt with a new file (hook 5 makes fairseq's
    # copies atomic under a stock backend too) instead of rewriting the one loaded in place
    resumed_from = work / "resumed_from.pt"
    assert os.stat(resumed_from).st_ino != os.stat(work / "resumed" / "checkpoint_last.pt").st_ino
    assert resumed_from.read_bytes() == (work / "full" / "checkpoint1.pt").read_bytes()


def test_a_plugin_checkpoint_resumes_under_legacy_ddp_with_its_adam_moments(
    runs: dict, corpus: Path, tmp_path: Path,
) -> None:
    """fairseq's Trainer refused it ("Optimizer does not match ... ShardedMasterOptimizer vs
    FairseqAdam"), and its --reset-optimizer restarts at update 0: the plugin's fp32 state
    is stock's layout, so it is handed over and the run ends as legacy_ddp's own did."""
    shutil.copyfile(runs["work"] / "fully_sharded" / "full" / "checkpoint1.pt",
                    tmp_path / "checkpoint_last.pt")
    resumed = _train(corpus, tmp_path, "legacy_ddp")
    full = result_of(runs["full"], "legacy_ddp")
    assert resumed["train_num_updates"] == full["train_num_updates"]
    for key in ("train_loss", "train_nll_loss", "train_gnorm"):
        assert float(resumed[key]) == pytest.approx(float(full[key]), rel=1e-3), key
    # --reset-optimizer (and so --finetune-from-model) takes the weights only, as before
    fresh = tmp_path / "reset"
    fresh.mkdir()
    shutil.copyfile(runs["work"] / "fully_sharded" / "full" / "checkpoint1.pt",
                    fresh / "checkpoint_last.pt")
    done = run_command([tool("fairseq-train"), *_args(corpus, fresh, "legacy_ddp"),
                        "--reset-optimizer"], env=rank_environment(), timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def test_a_checkpoint_rewritten_in_place_after_the_load_leaves_the_trainer_state_alone(
    runs: dict, corpus: Path, tmp_path: Path,
) -> None:
    """Another file copied over the loaded one (as ``cp`` does) must not reach the
    optimizer state the trainer keeps, under either backend: the silent variant, wrong
    numbers without a NaN."""
    def rewrite(backend: str) -> dict:
        source, work = runs["work"] / backend / "full", tmp_path / backend
        work.mkdir()
        loaded, report = work / "checkpoint_last.pt", work / "report.json"
        shutil.copyfile(source / "checkpoint1.pt", loaded)
        run_helper(REWRITE_HELPER, str(loaded), str(source / "checkpoint3.pt"), str(report),
                   *_args(corpus, work / "unused", backend), nproc=1)
        return json.loads(report.read_text())

    found = in_threads({backend: (lambda b=backend: rewrite(b)) for backend in BACKENDS})
    for backend in BACKENDS:
        report = result_of(found, backend)
        assert report["tensors"] > 0, (backend, report)
        assert report["changed"] == 0, (backend, report)


@pytest.mark.parametrize("checkpoint_format", ["full", "sharded"])
def test_optimizer_state_that_does_not_fit_is_refused_before_training(
    corpus: Path, tmp_path: Path, checkpoint_format: str
) -> None:
    """Moments of another shape (a hand-edited file; the states of two parameters swapped
    in a sharded index) used to load, then fail at the first step in a traceback."""
    args = [*training_args(corpus, tmp_path, max_update=2, max_tokens=4096), *TINY,
            "--user-dir", str(PLUGIN_DIR), "--task", "sharded_translation",
            "--ddp-backend", "fully_sharded", "--checkpoint-format", checkpoint_format]
    done = run_command([tool("fairseq-train"), *args], env=rank_environment(), timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    last = tmp_path / "checkpoint_last.pt"
    state = torch.load(last, weights_only=True)
    moments = state["last_optimizer_state"]["state"]
    if checkpoint_format == "full":
        moments[0]["exp_avg"] = torch.zeros(3, 3)
    else:
        moments[0], moments[1] = moments[1], moments[0]
    torch.save(state, last)
    args[args.index("--max-update") + 1] = "4"
    resumed = run_command([tool("fairseq-train"), *args], env=rank_environment(), timeout=300)
    assert resumed.returncode != 0
    lines = resumed.stderr.strip().splitlines()
    assert lines[-1].startswith(f"fairseq-shard-plugin: error: {last}: its optimizer state "
                                "does not fit this model's parameters ("), lines[-1]
    assert lines[-1].endswith(  # not --reset-optimizer: fairseq would restart at update 0
        f"; to train on from its weights with a fresh optimizer, give --finetune-from-model "
        f"{last} and a new --save-dir (--reset-optimizer would restart at update 0 and save "
        "over this save dir's checkpoints)"), lines[-1]
    assert "Traceback" not in resumed.stderr, resumed.stderr[-3000:]


@pytest.mark.parametrize(("changed", "said"), [
    (("--share-all-embeddings", "--share-decoder-input-output-embed"),
     "its model shares parameters differently from this one (--share-all-embeddings on in the "
     "checkpoint, off now), so its optimizer state does not fit (state for "),
    (("--adam-betas", "--momentum"), "its optimizer state is --optimizer adam's, this run has "
                                     "--optimizer nag; to train on from its weights"),
    # fairseq's own assertion advised --reset-optimizer: a restart over the save dir
    (("--criterion", "cross_entropy"), "it was trained with the criterion "
     "LabelSmoothedCrossEntropyCriterion, this run has CrossEntropyCriterion; to train on "
     "from its weights")])
def test_a_resume_with_other_ties_or_another_optimizer_names_the_flag(
    runs: dict, tmp_path: Path, corpus: Path, changed: tuple[str, str], said: str
) -> None:
    """Another tie loaded the weights (same names and shapes) and blamed the optimizer state,
    advising --reset-optimizer, which restarts at update 0 over the save dir's checkpoints;
    another optimizer took Adam's state and failed at its first step (KeyError: 'momentum')."""
    shutil.copyfile(runs["work"] / "fully_sharded" / "full" / "checkpoint1.pt",
                    tmp_path / "checkpoint_last.pt")
    before = (tmp_path / "checkpoint_last.pt").read_bytes()
    args = _args(corpus, tmp_path, "fully_sharded")
    at = args.index(changed[0])
    if changed[0] == "--adam-betas":
        args[at:at + 2] = ["--momentum", "0.9"]
        args[args.index("adam")] = "nag"
    elif changed[0] == "--criterion":
        args[at + 1] = changed[1]
        smoothing = args.index("--label-smoothing")
        del args[smoothing:smoothing + 2]
    else:
        args[at] = changed[1]
    done = run_command([tool("fairseq-train"), *args], env=rank_environment(), timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"fairseq-shard-plugin: error: {tmp_path / 'checkpoint_last.pt'}: {said}"), \
        done.stderr[-2000:]
    assert (tmp_path / "checkpoint_last.pt").read_bytes() == before


def test_a_resume_with_the_chunked_loss_continues(runs: dict, tmp_path: Path,
                                                  corpus: Path) -> None:
    """The chunked criterion computes label-smoothed cross-entropy, and neither keeps state:
    fairseq refused the resume by class name and advised --reset-optimizer (a restart at
    update 0 over the save dir's checkpoints)."""
    shutil.copyfile(runs["work"] / "fully_sharded" / "full" / "checkpoint1.pt",
                    tmp_path / "checkpoint_last.pt")
    args = _args(corpus, tmp_path, "fully_sharded")
    args[args.index("label_smoothed_cross_entropy")] = "chunked_label_smoothed_cross_entropy"
    done = run_command([tool("fairseq-train"), *args], env=rank_environment(), timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    summary = parse_logs(done.stdout + done.stderr)["train"][-1]
    full = result_of(runs["full"], "fully_sharded")
    assert summary["train_num_updates"] == full["train_num_updates"]
    assert abs(float(summary["train_loss"]) - float(full["train_loss"])) < 0.01


def test_a_resume_says_which_saved_values_fairseq_keeps(runs: dict, tmp_path: Path,
                                                        corpus: Path) -> None:
    """fairseq resumes with the optimizer's saved betas and weight decay: a new --adam-betas
    had no effect while the next checkpoint's config recorded it (resumeT #2)."""
    from fairseq_shard_plugin.checkpoint.resume_notices import changed_batching

    last = tmp_path / "checkpoint_last.pt"
    shutil.copyfile(runs["work"] / "fully_sharded" / "full" / "checkpoint1.pt", last)
    args = _args(corpus, tmp_path, "fully_sharded")
    args[args.index("--adam-betas") + 1] = "(0.5, 0.6)"
    args += ["--weight-decay", "0.1"]
    done = run_command([tool("fairseq-train"), *args], env=rank_environment(), timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert (f"{last}: the checkpoint's optimizer state keeps betas (0.9, 0.98), weight_decay "
            "0.0, which fairseq resumes with (this command gives betas (0.5, 0.6), "
            "weight_decay 0.1); to train with the new values, add --optimizer-overrides "
            "\"{'betas': (0.5, 0.6), 'weight_decay': 0.1}\"") in done.stdout + done.stderr
    # one key given already: the line's flag keeps it (a second flag would replace it)
    partly = [*args, "--optimizer-overrides", "{'betas': (0.5, 0.6)}"]
    shutil.copyfile(runs["work"] / "fully_sharded" / "full" / "checkpoint1.pt", last)
    done = run_command([tool("fairseq-train"), *partly], env=rank_environment(), timeout=300)
    assert ("give --optimizer-overrides \"{'betas': (0.5, 0.6), 'weight_decay': 0.1}\""
            in done.stdout + done.stderr), (done.stdout + done.stderr)[-3000:]
    overridden = [*args, "--optimizer-overrides", "{'betas': (0.5, 0.6), 'weight_decay': 0.1}"]
    shutil.copyfile(runs["work"] / "fully_sharded" / "full" / "checkpoint1.pt", last)
    done = run_command([tool("fairseq-train"), *overridden], env=rank_environment(),
                       timeout=300)
    assert done.returncode == 0 and "optimizer state keeps" not in done.stdout + done.stderr
    # an epoch resumed in its middle under other batching
    state = {"cfg": {"dataset": {"max_tokens": 1024, "batch_size": None}},
             "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 6}}}
    assert changed_batching(state, {"max_tokens": 2048, "batch_size": None}) == (
        "epoch 1 resumes after 6 batches per rank, batched or shuffled otherwise than when "
        "saved (--max-tokens 1024 then, 2048 now): they are other sentences, so part of the epoch "
        "is skipped or seen twice (the next epochs are whole); the saved batching continues "
        "it exactly, --reset-dataloader starts over at epoch 1")
    assert changed_batching(state, {"max_tokens": 1024, "batch_size": None}) is None
    assert "(--batch-size None then, 8 now)" in changed_batching(  # set where it was not
        state, {"max_tokens": 1024, "batch_size": 8})
    state["cfg"]["common"] = {"seed": 1}  # another shuffle of the epoch's batches
    assert "(--seed 1 then, 2 now)" in changed_batching(
        state, {"max_tokens": 1024, "batch_size": None}, seed=2)
    assert changed_batching(state, {"max_tokens": 1024, "batch_size": None}, seed=1) is None
    state["extra_state"]["train_iterator"]["iterations_in_epoch"] = 0  # at an epoch's end
    assert changed_batching(state, {"max_tokens": 2048, "batch_size": None}) is None


def test_the_overrides_advice_under_hydra_is_the_key_quoted_for_the_shell() -> None:
    """fairseq-hydra-train takes no --optimizer-overrides flag (attackB #6)."""
    from fairseq_shard_plugin.checkpoint.resume_notices import ignored_hyperparameters

    state = {"last_optimizer_state": {"param_groups": [{"betas": [0.9, 0.98], "lr": 1.0}]}}
    assert ignored_hyperparameters(state, {"betas": (0.5, 0.6), "lr": 2.0}, "{}",
                                   hydra=True).endswith(
        "add \"checkpoint.optimizer_overrides=\\\"{'betas': (0.5, 0.6)}\\\"\"")
    assert ignored_hyperparameters(state, {"betas": (0.9, 0.98), "lr": 2.0}, "{}") is None


@pytest.mark.parametrize("checkpoint_format", ["full", "sharded"])
def test_a_run_that_saved_no_optimizer_state_continues_at_its_update(
    runs: dict, tmp_path: Path, corpus: Path, checkpoint_format: str
) -> None:
    """--no-save-optimizer-state: rerunning the command was refused as if the checkpoint were
    an export, with advice that failed the same way (T1 #1); stock continues at update 0.
    It continues at the saved update, with the saved schedule and a fresh optimizer."""
    args = [*_args(corpus, tmp_path, "fully_sharded"), "--no-save-optimizer-state",
            "--checkpoint-format", checkpoint_format]
    epoch = args.index("--max-epoch")
    args[epoch + 1] = "1"
    done = run_command([tool("fairseq-train"), *args], env=rank_environment(), timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    args[epoch + 1] = "3"
    done = run_command([tool("fairseq-train"), *args], env=rank_environment(), timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert re.search(r"its run saved no optimizer state \(--no-save-optimizer-state\): "
                     r"continuing at its update \(\d+; fairseq's line below says 0\) with its "
                     r"weights, data position and learning-rate schedule, and a fresh "
                     r"optimizer", output), output[-3000:]
    summary = parse_logs(output)["train"][-1]
    full = result_of(runs["full"], "fully_sharded")
    assert summary["epoch"] == full["epoch"] == 3
    # fairseq-shard-verify calls such a checkpoint resumable (it called it an export, and
    # --newest found nothing for a requeued job's --restore-file, T4 #2)
    from fairseq_shard_plugin.checkpoint import verify

    verdict = verify.check(tmp_path / "checkpoint_last.pt")
    assert verdict.resumable and "resumes with a fresh optimizer" in verdict.line
    # its export is one for inference (it was taken for such a checkpoint: the config's flag)
    from fairseq_shard_plugin.checkpoint.consolidate import export_consolidated

    export = verify.check(export_consolidated(tmp_path / "checkpoint_last.pt",
                                              tmp_path / "export" / "model.pt"))
    assert export.intact and not export.resumable, export.line
    assert summary["train_num_updates"] == full["train_num_updates"]  # not restarted at 0
    assert summary["train_lr"] == full["train_lr"]  # the schedule went on from its update
    assert 0 < float(summary["train_loss"]) < 20


def test_a_resume_under_another_lr_scheduler_names_the_flag(
    tmp_path: Path, corpus: Path
) -> None:
    """fixed's saved state has no 'best' for inverse_sqrt: the line said only "could not be
    loaded: KeyError: 'best'", blaming the checkpoint, and the traceback was gone (T1 #2)."""
    args = _args(corpus, tmp_path, "fully_sharded")
    fixed = list(args)
    fixed[fixed.index("inverse_sqrt")] = "fixed"
    warmup = fixed.index("--warmup-updates")
    del fixed[warmup:warmup + 2]
    fixed[fixed.index("--max-epoch") + 1] = "1"
    done = run_command([tool("fairseq-train"), *fixed], env=rank_environment(), timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    last = tmp_path / "checkpoint_last.pt"
    before = last.read_bytes()
    done = run_command([tool("fairseq-train"), *args], env=rank_environment(), timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"fairseq-shard-plugin: error: {last}: its learning-rate schedule (--lr-scheduler "
        "fixed) does not load into this run's --lr-scheduler inverse_sqrt (KeyError: 'best'): "
        "add --reset-lr-scheduler to let inverse_sqrt take over at the checkpoint's update "
        "(weights, optimizer state and update count are kept)")
    assert last.read_bytes() == before
    done = run_command([tool("fairseq-train"), *args, "--reset-lr-scheduler"],
                       env=rank_environment(), timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert parse_logs(done.stdout + done.stderr)["train"][-1]["epoch"] == 3


def test_a_fine_tune_into_a_save_dir_of_another_run_says_it_resumes_that_run(
    runs: dict, tmp_path: Path, corpus: Path
) -> None:
    """fairseq loads --finetune-from-model only into a save dir without checkpoint_last.pt;
    given another run's, it resumed that run's Adam state and schedule under the new
    settings without a word (T3 #3). A fine-tune's own checkpoint resumes silently."""
    pretrained = runs["work"] / "fully_sharded" / "full" / "checkpoint_last.pt"
    other = tmp_path / "other"
    other.mkdir()
    shutil.copyfile(runs["work"] / "fully_sharded" / "full" / "checkpoint1.pt",
                    other / "checkpoint_last.pt")
    args = [*_args(corpus, other, "fully_sharded"), "--finetune-from-model", str(pretrained)]
    done = run_command([tool("fairseq-train"), *args], env=rank_environment(), timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert (f"--finetune-from-model {pretrained} is not loaded: {other / 'checkpoint_last.pt'} "
            "exists and fairseq resumes it instead") in done.stdout + done.stderr
    own = tmp_path / "own"
    args = [*_args(corpus, own, "fully_sharded"), "--finetune-from-model", str(pretrained)]
    args[args.index("--max-epoch") + 1] = "1"
    done = run_command([tool("fairseq-train"), *args], env=rank_environment(), timeout=300)
    assert done.returncode == 0 and "loading pretrained model from" in done.stdout + done.stderr
    args[args.index("--max-epoch") + 1] = "2"
    done = run_command([tool("fairseq-train"), *args], env=rank_environment(), timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "is not loaded" not in done.stdout + done.stderr


def test_a_save_dir_that_lost_its_last_checkpoint_is_not_trained_over(
    runs: dict, tmp_path: Path, corpus: Path
) -> None:
    """checkpoint_last.pt deleted (or never written: a first save that failed) beside a
    run's other checkpoints: fairseq started from scratch and saved over all of them,
    without a word (T2 #1). Refused before training, naming the newest."""
    full = runs["work"] / "fully_sharded" / "full"
    for name in ("checkpoint1.pt", "checkpoint2.pt"):
        shutil.copyfile(full / name, tmp_path / name)
    (tmp_path / "checkpoint_notes.pt").write_text("not a checkpoint")  # not counted, nor
    shutil.copyfile(full / "checkpoint2.pt", tmp_path / "checkpoint2_x.pt")  # another suffix's
    os.mkfifo(tmp_path / "checkpoint3.pt")  # never opened (the check waited on it, T4 #3)
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.is_file()}
    done = run_command([tool("fairseq-train"), *_args(corpus, tmp_path, "fully_sharded")],
                       env=rank_environment(), timeout=300)
    assert done.returncode == 1
    updates = torch.load(full / "checkpoint2.pt", weights_only=True)["optimizer_history"][
        -1]["num_updates"]
    assert done.stderr.strip().splitlines()[-1] == (
        f"fairseq-shard-plugin: error: {tmp_path} holds 2 training checkpoint(s) and it has "
        "no checkpoint_last.pt, so fairseq would train from scratch and save over them: to "
        f"resume, give --restore-file {tmp_path / 'checkpoint2.pt'} (the newest, update "
        f"{updates}; fairseq-shard-verify {tmp_path} checks them); to start anew, give "
        "another --save-dir")
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()
            if path.is_file()} == before


def test_a_fine_tune_resumed_from_another_working_directory_is_its_own() -> None:
    """The path stored by the fine-tune's first launch is relative to its working directory:
    a requeue from elsewhere was told its own checkpoint_last.pt was another run's (T4 #7)."""
    from fairseq_shard_plugin.training.validation import _same_file

    assert _same_file("base/checkpoint_last.pt", "runs/base/checkpoint_last.pt")
    assert _same_file("/data/base/model.pt", "base/model.pt")
    assert not _same_file("base/checkpoint_last.pt", "other/checkpoint_last.pt")
    assert not _same_file("/data/a/model.pt", "/data/b/model.pt")
