"""A run of stock fairseq's own ``fully_sharded`` (fairscale, as the NLLB recipe trains)
switched to the plugin: it continues from stock's checkpoints.

Stock fairseq and fairscale train and save with their own code on 2 CPU ranks
(tests/helpers/stock_fully_sharded.py stands in for CUDA, nothing else), with every layer
its own fairscale unit (``--min-params-to-wrap``), so that the units' order is not the
model's. The reference is stock fairseq's uninterrupted run (stock 0.12 cannot resume such
a run itself here: its load fails on the nested units' names).
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

import pytest
import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel
from test_checkpoints import generate_command, hypotheses

from fairseq_shard_plugin.checkpoint import verify
from fairseq_shard_plugin.checkpoint.errors import CheckpointLoadError
from fairseq_shard_plugin.checkpoint.fairscale_shards import consolidated_state, in_model_order
from fairseq_shard_plugin.checkpoint.reading import read_checkpoint
from launching.harness import (
    PLUGIN_DIR,
    REPO,
    RunResult,
    in_threads,
    result_of,
    run_command,
    run_concurrently,
    run_training,
    tool,
    training_args,
)

from tiny_training import TINY

STOCK_TRAIN = f"{sys.executable} {REPO / 'tests' / 'helpers' / 'stock_fully_sharded.py'}"
SAVED_AT, RESUMED_TO = 10, 14
LAYER_UNITS = ["--min-params-to-wrap", "10000"]  # TINY's layers have about 33K parameters
PER_RANK_FILES = ["--use-sharded-state", "--save-interval-updates", "5"]
# fp16 as the NLLB recipe trains (fairscale's mixed precision over fp32 shards, fairseq's
# MemoryEfficientFP16Optimizer and its loss scale)
PRECISIONS = {"fp32": [], "fp16": ["--fp16", "--on-cpu-convert-precision"]}


def stock_fully_sharded(args: list[str]) -> RunResult:
    return run_training(args + ["--task", "translation", *LAYER_UNITS], nproc=2, plugin=False,
                        stock_backend="fully_sharded",
                        environment={"FAIRSEQ_TRAIN": STOCK_TRAIN})


@pytest.fixture(scope="module", params=list(PRECISIONS))
def stock_runs(request: pytest.FixtureRequest, corpus: Path,
               tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Stock fairseq's save dir after 10 updates with per-rank files (checkpoint_1_5-shard
    {0,1}.pt, checkpoint_1_10-shard{0,1}.pt, checkpoint_last-shard{0,1}.pt, ...), the same
    training uninterrupted to update 14, and (fp32) its save dir in the full format."""
    precision = PRECISIONS[request.param]
    dirs = {name: tmp_path_factory.mktemp(name) for name in ("per_rank", "uninterrupted", "full")}
    jobs = {
        "per_rank": lambda: stock_fully_sharded(
            training_args(corpus, dirs["per_rank"], SAVED_AT) + TINY + precision
            + PER_RANK_FILES),
        "uninterrupted": lambda: stock_fully_sharded(
            training_args(corpus, dirs["uninterrupted"], RESUMED_TO) + TINY + precision
            + ["--no-save"]),
    }
    if request.param == "fp32":
        jobs["full"] = lambda: stock_fully_sharded(
            training_args(corpus, dirs["full"], SAVED_AT) + TINY)
    results = in_threads(jobs)
    runs = {name: result_of(results, name) for name in jobs}
    assert (dirs["per_rank"] / "checkpoint_last-shard1.pt").is_file()
    return {"precision": precision, "save_dir": dirs["per_rank"],
            "full": dirs["full"] if "full" in jobs else None,
            "uninterrupted": runs["uninterrupted"]}


def once(stock_runs: dict) -> Path:
    """The save dir, for tests of the set itself, run on the fp32 set only (the fp16 one
    is laid out alike)."""
    if stock_runs["full"] is None:
        pytest.skip("run once, on the fp32 set")
    return stock_runs["save_dir"]


def digests(directory: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in directory.glob("*-shard*.pt")}


def test_the_plugin_continues_a_stock_fully_sharded_run_exactly(
    corpus: Path, stock_runs: dict, tmp_path: Path
) -> None:
    """Same command, the plugin's task and user dir added: no checkpoint_last.pt exists, so
    it continues from checkpoint_last-shard0.pt and its set, with the Adam moments (and the
    loss scale), and logs the losses and gradient norms of stock's uninterrupted run.
    Stock's files stay as they were."""
    precision = stock_runs["precision"]
    dirs = {name: tmp_path / name for name in ("plugin", "plugin_reset")}
    for directory in dirs.values():
        shutil.copytree(stock_runs["save_dir"], directory)
    before = digests(dirs["plugin"])
    plugin, reset = (
        run_training(training_args(corpus, dirs[name], RESUMED_TO) + TINY + precision
                     + ["--task", "sharded_translation", *flags], nproc=2, plugin=True)
        if name == "plugin" or not precision else None
        for name, flags in (("plugin", ["--use-sharded-state"]),
                            ("plugin_reset", ["--reset-optimizer"])))  # (reset: fp32 only)
    assert "continuing from" in plugin.output and "checkpoint_last-shard0.pt" in plugin.output
    stock = stock_runs["uninterrupted"]
    reference = {key: stock.series("train_inner", key)[SAVED_AT:] for key in ("loss", "gnorm")}
    assert len(reference["loss"]) == RESUMED_TO - SAVED_AT
    for key, values in reference.items():
        assert plugin.series("train_inner", key) == pytest.approx(values, abs=1.5e-3), key
    if reset is not None:  # without the moments the same weights train differently
        assert reset.series("train_inner", "loss") != pytest.approx(reference["loss"],
                                                                    abs=1.5e-3)
    assert digests(dirs["plugin"]) == before
    assert (dirs["plugin"] / "checkpoint_last.pt").is_file()  # the plugin's own, beside


def fairscale_model(save_dir: Path, name: str) -> dict[str, torch.Tensor]:
    """fairscale's own consolidation of a set (the reference for the plugin's)."""
    states = [read_checkpoint(save_dir / f"{name}-shard{rank}.pt") for rank in (0, 1)]
    return FullyShardedDataParallel.consolidate_shard_weights(
        [state["model"] for state in states], [state["fsdp_metadata"] for state in states],
        strict=False)  # (fairseq's sinusoidal positions are listed, not saved)


def consolidate(first: Path, shapes: dict[str, torch.Size] | None) -> dict:
    return consolidated_state(str(first), read_checkpoint(first), read_checkpoint, shapes,
                              None, [])


def model_order(state: dict) -> list[str]:
    """The parameter names of the checkpoint's model, in the model's order: fairseq builds
    the model from the checkpoint's own config."""
    from fairseq.tasks.translation import TranslationTask

    args = state["cfg"]["model"]  # an argparse.Namespace, as fairseq's legacy archs keep it
    model = TranslationTask.setup_task(args).build_model(args)
    return [name for name, _ in model.named_parameters()]


def test_a_full_stock_checkpoint_has_its_optimizer_state_put_in_the_models_order(
    stock_runs: dict,
) -> None:
    """Without --use-sharded-state stock writes one full checkpoint, whose optimizer state
    fairscale gathered unit by unit (the root's parameters, then each layer's: not the
    model's order). Re-indexed by name in the model's order, it equals the per-rank files'
    state of the same training (same seed, same updates, equal weights). The second moments
    are compared: on CPU ranks fairscale's gather stores its all-gather buffer itself as the
    first moments (``.cpu()`` of a CPU tensor is no copy), which the second moments' gather
    then overwrites, so this file's exp_avg holds exp_avg_sq (on CUDA ``.cpu()`` copies)."""
    if stock_runs["full"] is None:
        pytest.skip("the full-format run is fp32 only")
    full = read_checkpoint(stock_runs["full"] / "checkpoint_last.pt")
    names = model_order(full)
    gathered = [f"{unit['fsdp_path']}.{name}" if unit["fsdp_path"] else name
                for unit in full["fsdp_metadata"]["param_metadata"]
                for entry in unit["params"].values() for name in entry["names"]]
    assert sorted(gathered) == sorted(names) and gathered != names
    first = stock_runs["save_dir"] / "checkpoint_last-shard0.pt"
    per_rank = consolidated_state(str(first), read_checkpoint(first), read_checkpoint, None,
                                  names, [])
    ordered = in_model_order("full.pt", full, names)
    for index, name in enumerate(names):
        assert torch.equal(full["model"][name], per_rank["model"][name]), name
        ours, theirs = (state["last_optimizer_state"]["state"][index]
                        for state in (ordered, per_rank))
        assert ours["step"] == theirs["step"] == SAVED_AT
        assert torch.equal(ours["exp_avg_sq"], theirs["exp_avg_sq"]), name


def test_parameters_put_together_are_fairscales_own_consolidation(stock_runs: dict) -> None:
    """(fairscale's own misses the tied output projection with nested units: it copies the
    shared parameters its last unit records.)"""
    stock_save_dir = once(stock_runs)
    reference = fairscale_model(stock_save_dir, "checkpoint_1_10")
    model = consolidate(stock_save_dir / "checkpoint_1_10-shard0.pt", None)["model"]
    assert set(reference) <= set(model)
    for name, tensor in reference.items():
        assert torch.equal(model[name], tensor), name
    assert model["encoder.embed_tokens.weight"].shape[0] > 500  # the whole vocabulary


@pytest.mark.parametrize("damage", ["missing", "mixed", "swapped", "renamed", "other_model",
                                    "crafted_shapes", "crafted_keys"])
def test_an_incomplete_or_mixed_set_is_refused_in_one_line(
    stock_runs: dict, tmp_path: Path, damage: str
) -> None:
    stock_save_dir = once(stock_runs)
    shapes = {name: tensor.shape for name, tensor in consolidate(
        stock_save_dir / "checkpoint_last-shard0.pt", None)["model"].items()}
    save_dir = tmp_path / "save"
    shutil.copytree(stock_save_dir, save_dir)
    first = save_dir / "checkpoint_last-shard0.pt"
    if damage == "missing":
        (save_dir / "checkpoint_last-shard1.pt").unlink()
        expected = "holds 1 of their files (missing: checkpoint_last-shard1.pt)"
    elif damage == "mixed":  # another save's file under this set's name
        shutil.copy(save_dir / "checkpoint_1_5-shard1.pt", save_dir / "checkpoint_last-shard1.pt")
        expected = "checkpoint_last-shard1.pt was saved after 5 updates"
    elif damage == "swapped":  # each rank's file under the other's name
        (save_dir / "checkpoint_last-shard0.pt").rename(save_dir / "swap")
        (save_dir / "checkpoint_last-shard1.pt").rename(save_dir / "checkpoint_last-shard0.pt")
        (save_dir / "swap").rename(save_dir / "checkpoint_last-shard1.pt")
        expected = "checkpoint_last-shard0.pt was saved by rank 1, not rank 0"
    elif damage == "renamed":
        first = Path(shutil.copy(first, save_dir / "stock-copy.pt"))
        expected = "its name is not fairseq's NAME-shardN.pt"
    elif damage == "other_model":
        shapes["encoder.embed_tokens.weight"] = torch.Size([9, 64])
        expected = "encoder.embed_tokens.weight has shape"
    else:  # both files' fsdp_metadata edited: shapes that do not hold the counted
        for rank in (0, 1):  # elements, a key gone
            path = save_dir / f"checkpoint_last-shard{rank}.pt"
            state = torch.load(path, weights_only=True)
            entry = state["fsdp_metadata"]["param_metadata"][0]["params"]["flat_param_0"]
            if damage == "crafted_shapes":
                entry["shapes"] = [(3, 3), *entry["shapes"][1:]]
                expected = "the fsdp_metadata of flat_param_0 lists"
            else:
                del entry["numels"]
                expected = "its fully_sharded set cannot be put together: KeyError: 'numels'"
            torch.save(state, path)
    with pytest.raises(CheckpointLoadError) as refused:
        consolidate(first, shapes)
    message = str(refused.value)
    assert expected in message and "\n" not in message and message.startswith(str(first))
    verdict = verify.check(first)  # fairseq-shard-verify judges the set too
    assert verdict.intact == (damage == "other_model")
    if damage not in ("other_model", "renamed", "crafted_shapes"):
        assert expected in verdict.line


def test_a_stock_set_exports_for_stock_tools_and_translates_with_the_plugin(
    corpus: Path, stock_runs: dict, tmp_path: Path
) -> None:
    """``fairseq-shard-consolidate`` of any file of the set writes one standard checkpoint
    that stock fairseq-generate (never importing the plugin) translates; fairseq-generate
    with the plugin translates the set itself alike (stock fairseq 0.12 cannot: its
    ``--checkpoint-shard-count`` path fails on the sinusoidal positions' buffer names), and
    refuses a broken set in one line. fairseq-shard-verify names each file's rank."""
    stock_save_dir = once(stock_runs)
    export = tmp_path / "model.pt"
    broken = tmp_path / "broken"
    shutil.copytree(stock_save_dir, broken)
    (broken / "checkpoint_last-shard1.pt").unlink()
    finished = run_concurrently({
        "broken": generate_command(corpus, broken / "checkpoint_last-shard0.pt"),
        "export": [tool("fairseq-shard-consolidate"),
                   str(stock_save_dir / "checkpoint_last-shard1.pt"), str(export)],
        "verify": [tool("fairseq-shard-verify"), str(stock_save_dir)],
        "plugin": generate_command(corpus, stock_save_dir / "checkpoint_last-shard0.pt")})
    assert finished["export"].returncode == 0, finished["export"].stderr[-3000:]
    stock = [part for part in generate_command(corpus, export)
             if part not in ("--user-dir", str(PLUGIN_DIR))]
    from_export = run_command(stock)
    assert "fairseq_shard_plugin" not in from_export.stderr
    assert hypotheses(from_export) == hypotheses(finished["plugin"])
    assert "checkpoint_last-shard0.pt: ok (rank 0 of 2 of fairseq's fully_sharded state, " \
        f"update {SAVED_AT}, resumes in epoch 1)" in finished["verify"].stdout
    # a broken set: fairseq-generate ends in the plugin's one line, not a traceback
    assert finished["broken"].returncode != 0 and "Traceback" not in finished["broken"].stderr
    assert finished["broken"].stderr.strip().splitlines()[-1].startswith(
        f"fairseq-shard-plugin: error: {broken / 'checkpoint_last-shard0.pt'}: saved by 2 ranks")


def test_a_rank_file_without_the_gathered_optimizer_state_says_which_file_has_it(
    stock_runs: dict,
) -> None:
    """The nllb branch names even its full files NAME-shardR.pt, and only rank 0's holds
    the gathered optimizer state (the others hold -1)."""
    if stock_runs["full"] is None:
        pytest.skip("the full-format run is fp32 only")
    full = read_checkpoint(stock_runs["full"] / "checkpoint_last.pt")
    full["last_optimizer_state"] = -1
    with pytest.raises(CheckpointLoadError) as refused:
        in_model_order("checkpoint_last-shard1.pt", full, model_order(full))
    assert "checkpoint_last-shard1.pt: holds no optimizer state" in str(refused.value)
    assert "NAME-shard0.pt" in str(refused.value)


def test_resumed_on_another_number_of_ranks_the_epoch_continues_where_stock_left_it(
    corpus: Path, stock_runs: dict, tmp_path: Path
) -> None:
    """fairseq counts the position in the epoch per rank; the set records how many ranks
    saved it, so one rank continues after all 20 batches the 2 stock ranks drew."""
    if stock_runs["full"] is None:
        pytest.skip("once, in fp32")
    save_dir = tmp_path / "save"
    shutil.copytree(stock_runs["save_dir"], save_dir)
    one_rank = run_training(training_args(corpus, save_dir, SAVED_AT + 1) + TINY
                            + ["--task", "sharded_translation"], nproc=1, plugin=True)
    assert ("checkpoint saved on 2 ranks, resumed on 1: epoch 1 continues after 20 of its "
            "batches") in one_rank.output
    assert len(one_rank.series("train_inner", "loss")) == 1
