"""Real fairseq-train runs on CPU gloo ranks: the plugin against stock fairseq."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from fairseq_shard_plugin.training.data_position import convert_position, record_ranks
from launching.harness import (
    PLUGIN_DIR,
    REPO,
    RunResult,
    in_threads,
    result_of,
    run_command,
    run_helper,
    run_training,
    tool,
    training_args,
)

from tiny_training import REFERENCE_UPDATES, TINY, relative_difference

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)

# Variants train this many updates and compare with the reference runs' first ones.
UPDATES = 20


def first(run: RunResult, key: str) -> list[float]:
    """The reference run's per-update ``key`` over the first UPDATES updates."""
    return run.series("train_inner", key)[:UPDATES]


def test_each_layer_is_a_unit_and_each_rank_holds_its_slice(corpus: Path, tmp_path: Path) -> None:
    run_helper(REPO / "tests" / "helpers" / "inspect_sharding.py", str(tmp_path), str(corpus),
               *TINY, "--task", "sharded_translation", "--optimizer", "adam", "--lr", "1e-3",
               "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
               "--cpu", "--ddp-backend", "fully_sharded")
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(report["layers"]) == 4
        layers = report["layers"].values()
        assert all(layer["is_unit"] and layer["owns_exactly"] for layer in layers)
        for name, param in report["params"].items():
            assert param["dtensor"] and param["slice_matches"], name
        held = sum(p["local_numel"] for p in report["params"].values())
        total = sum(p["full_numel"] for p in report["params"].values())
        assert abs(held / total - 0.5) < 0.01
        assert report["sharded_grad_norm"] == pytest.approx(report["gathered_grad_norm"], rel=1e-5)


def test_sharded_loss_matches_stock_unsharded_tiny_run(
    stock_tiny_run: RunResult, sharded_tiny_run: tuple[RunResult, Path]
) -> None:
    sharded, _ = sharded_tiny_run
    stock_loss = stock_tiny_run.series("train_inner", "loss")
    sharded_loss = sharded.series("train_inner", "loss")
    assert len(stock_loss) == len(sharded_loss) == REFERENCE_UPDATES
    assert relative_difference(sharded_loss, stock_loss) <= 1e-4
    assert sharded_loss[-1] < sharded_loss[0]
    valid = sharded.series("valid", "valid_loss")
    stock_valid = stock_tiny_run.series("valid", "valid_loss")
    assert valid and relative_difference(valid, stock_valid) <= 1e-4


def test_validation_translates_as_stock_fairseq_does(
    stock_tiny_run: RunResult, sharded_tiny_run: tuple[RunResult, Path]
) -> None:
    """--eval-bleu: fairseq's generator calls the encoder and decoder directly, and ranks
    decode different numbers of steps; the plugin gathers the model around validation, so
    the sharded run logs the same hypotheses and BLEU as stock fairseq."""
    sharded, _ = sharded_tiny_run

    def hypotheses(run: RunResult) -> list[str]:
        return re.findall(r"example hypothesis: (.*)", run.output)

    assert hypotheses(sharded) and hypotheses(sharded) == hypotheses(stock_tiny_run)
    bleu = sharded.series("valid", "valid_bleu")
    assert bleu and bleu == stock_tiny_run.series("valid", "valid_bleu")


def test_every_log_line_carries_peak_memory(sharded_tiny_run: tuple[RunResult, Path]) -> None:
    sharded, _ = sharded_tiny_run
    assert len(sharded.logs["train_inner"]) == REFERENCE_UPDATES  # one line per update
    for entry in sharded.logs["train_inner"]:
        assert float(entry["peak_mem_gb"]) > 0
        assert 0 < float(entry["state_mem_gb"]) <= float(entry["peak_mem_gb"])
    # validation lines too (here with --eval-bleu: the whole model gathered to translate)
    assert sharded.logs["valid"]
    for entry in sharded.logs["valid"]:
        assert 0 < float(entry["valid_state_mem_gb"]) <= float(entry["valid_peak_mem_gb"])


def test_plugin_with_another_ddp_backend_behaves_as_stock(
    corpus: Path, tmp_path: Path, stock_tiny_run: RunResult
) -> None:
    args = training_args(corpus, tmp_path, UPDATES) + TINY + [
        "--user-dir", str(PLUGIN_DIR), "--ddp-backend", "legacy_ddp",
        "--task", "sharded_translation", "--keep-vocabulary-gathered"]
    run = run_training(args, nproc=2, plugin=False)
    assert run.series("train_inner", "loss") == first(stock_tiny_run, "loss")
    assert "peak_mem_gb" not in run.logs["train_inner"][0]
    # an option of the plugin that cannot act here is named, not silently dropped
    # (the whole line: it once began "---name, --keep-vocabulary-gathered")
    named = [line.split(" | ")[-1] for line in run.output.splitlines()
             if "the plugin's options take effect only" in line]
    assert named == ["--keep-vocabulary-gathered: the plugin's options take effect only with "
                     "--ddp-backend fully_sharded (this run: legacy_ddp)"], run.output[-3000:]


def test_checkpoint_is_a_standard_full_checkpoint(
    corpus: Path, sharded_tiny_run: tuple[RunResult, Path]
) -> None:
    _, save_dir = sharded_tiny_run
    state = torch.load(save_dir / "checkpoint_last.pt", weights_only=True)
    embedding = state["model"]["encoder.embed_tokens.weight"]
    assert type(embedding) is torch.Tensor and embedding.shape == (608, 64)
    exp_avg = state["last_optimizer_state"]["state"][0]["exp_avg"]
    assert type(exp_avg) is torch.Tensor and exp_avg.shape[0] > 1
    # the tied embeddings and output projection are stored once, as in stock checkpoints
    tied = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
            "decoder.output_projection.weight")
    assert len({state["model"][name].untyped_storage().data_ptr() for name in tied}) == 1
    # --eval-bleu: fairseq's metrics state holds BLEU's n-gram counts as numpy arrays,
    # which the plugin's weights_only allow-list admits (resume and generate read them)
    bleu_counts = [meter for meter in state["extra_state"]["metrics"]["valid"]
                   if meter[1] == "_bleu_counts"]
    assert bleu_counts and isinstance(bleu_counts[0][3]["sum"], np.ndarray)
    generated = run_command(
        [tool("fairseq-generate"), str(corpus), "--path", str(save_dir / "checkpoint_last.pt"),
         "--user-dir", str(PLUGIN_DIR), "--cpu", "--beam", "2", "--max-tokens", "1000",
         "--max-len-b", "20"])
    assert generated.returncode == 0, generated.stderr[-3000:]
    hypotheses = [line for line in generated.stdout.splitlines() if line.startswith("H-")]
    translated = re.search(r"Translated (\d+) sentences", generated.stderr + generated.stdout)
    assert translated and len(hypotheses) == int(translated.group(1)) > 0


def test_the_log_says_how_large_a_checkpoint_is_before_the_first_save(
    sharded_tiny_run: tuple[RunResult, Path]
) -> None:
    run, save_dir = sharded_tiny_run
    lines = [line for line in run.output.splitlines() if "checkpoints of this run: about " in line]
    assert len(lines) == 1 and f"free in {save_dir}" in lines[0]
    announced = float(re.search(r"about ([0-9.]+) MiB each", lines[0]).group(1))
    written = (save_dir / "checkpoint_last.pt").stat().st_size / 2**20
    # (within 15% before the pickled config and the zip records were counted)
    assert abs(announced - written) / written < 0.03, (lines[0], written)


def test_chunked_criterion_and_activation_checkpointing_match_stock_with_a_lower_peak(
    corpus: Path, tmp_path: Path, stock_tiny_run: RunResult,
    sharded_tiny_run: tuple[RunResult, Path]
) -> None:
    """The chunked loss on the sharded tied embedding and fairseq's
    --checkpoint-activations inside each layer's unit: stock fairseq's losses and norms,
    and a lower peak than the plugin's plain run over the same batches."""
    args = training_args(corpus, tmp_path, UPDATES) + TINY + [
        "--task", "sharded_translation", "--criterion", "chunked_label_smoothed_cross_entropy",
        "--loss-chunk-tokens", "64", "--checkpoint-activations", "--no-save"]
    run = run_training(args, nproc=2, plugin=True)
    losses = run.series("train_inner", "loss")
    assert relative_difference(losses, first(stock_tiny_run, "loss")) <= 1e-4
    assert relative_difference(run.series("train_inner", "gnorm"),
                               first(stock_tiny_run, "gnorm")) <= 1e-3
    plain_peak = max(first(sharded_tiny_run[0], "peak_mem_gb"))  # the same 20 batches
    assert max(run.series("train_inner", "peak_mem_gb")) < 0.8 * plain_peak


def test_the_chunked_loss_trains_in_a_root_only_plan_as_stock(
    corpus: Path, tmp_path: Path, stock_tiny_run: RunResult
) -> None:
    """With --root-unit-only the output projection is no unit of its own: the fused loss runs
    as the root's forward method (it met the root's resharded weight, a DTensor, in a
    traceback at the first step)."""
    args = training_args(corpus, tmp_path, UPDATES) + TINY + [
        "--task", "sharded_translation", "--criterion", "chunked_label_smoothed_cross_entropy",
        "--loss-chunk-tokens", "64", "--root-unit-only", "--no-save"]
    run = run_training(args, nproc=2, plugin=True)
    for key in ("loss", "gnorm"):
        assert relative_difference(run.series("train_inner", key),
                                   first(stock_tiny_run, key)) <= 1e-4


def test_fconv_with_its_output_tied_to_the_embedding_trains_as_stock(
    corpus: Path, tmp_path: Path
) -> None:
    """--share-input-output-embed ties fconv's decoder.fc3 to its embedding: every rank
    failed in FSDP's shared-parameter check (fc3 was left in the root)."""
    args = training_args(corpus, tmp_path, 4, max_tokens=256) + [
        "--arch", "fconv_iwslt_de_en", "--encoder-embed-dim", "32", "--decoder-embed-dim",
        "32", "--decoder-out-embed-dim", "32", "--encoder-layers", "[(32, 3)] * 2",
        "--decoder-layers", "[(32, 3)] * 2", "--share-input-output-embed", "--no-save"]
    _trains_as_stock(args, updates=4)


def test_gradient_accumulation_over_update_freq_matches_stock(corpus: Path, tmp_path: Path) -> None:
    """--update-freq 2 (the NLLB recipes', and what the out-of-memory advice suggests):
    each micro-batch's gradients reduce-scatter into the shards and add up there, giving
    stock data parallelism's losses and norms."""
    args = training_args(corpus, tmp_path, 10, max_tokens=256) + TINY + [
        "--update-freq", "2", "--no-save"]
    stock = run_training(args, nproc=2, plugin=False)
    sharded = run_training([*args, "--task", "sharded_translation"], nproc=2, plugin=True)
    for key in ("loss", "gnorm"):
        assert len(sharded.series("train_inner", key)) == 10
        assert relative_difference(sharded.series("train_inner", key),
                                   stock.series("train_inner", key)) <= 1e-4


def test_adagrad_trains_sharded_as_stock(corpus: Path, tmp_path: Path) -> None:
    """Adagrad's state (a sum of squared gradients) is per element, though fairseq's wrapper
    says it cannot step flat parameters: sharded, it gives stock's losses and norms."""
    args = training_args(corpus, tmp_path, 5, max_tokens=256) + TINY + ["--no-save"]
    at = args.index("--adam-betas")
    args[args.index("adam")] = "adagrad"
    del args[at:at + 2]
    _trains_as_stock(args, updates=5)


def _trains_as_stock(args: list[str], updates: int) -> None:
    """Stock legacy_ddp and the plugin (2 ranks each, at once): the same losses and norms."""
    runs = in_threads({
        "stock": lambda: run_training(args, nproc=2, plugin=False),
        "sharded": lambda: run_training([*args, "--task", "sharded_translation"], nproc=2,
                                        plugin=True)})
    stock, sharded = result_of(runs, "stock"), result_of(runs, "sharded")
    for key in ("loss", "gnorm"):
        assert len(sharded.series("train_inner", key)) == updates
        assert relative_difference(sharded.series("train_inner", key),
                                   stock.series("train_inner", key)) <= 1e-4


def test_no_reshard_after_forward_keeps_units_gathered_and_trains_the_same(
    corpus: Path, tmp_path: Path, sharded_tiny_run: tuple[RunResult, Path]
) -> None:
    """fairseq's --no-reshard-after-forward (ZeRO-2, in NLLB sweeps) is honoured, not
    ignored: the same losses and norms, every step's peak higher by the gathered copies,
    and the checkpoint saved after validation (which leaves units gathered: no backward
    follows) holds the same model. (Every unit here, the vocabulary unit included, takes
    the path --keep-vocabulary-gathered takes for that unit alone.)"""
    args = training_args(corpus, tmp_path, UPDATES) + TINY + [
        "--task", "sharded_translation", "--no-reshard-after-forward",
        "--min-params-to-wrap", "0"]
    run = run_training(args, nproc=2, plugin=True)
    reference, reference_dir = sharded_tiny_run
    for key in ("loss", "gnorm"):
        assert run.series("train_inner", key) == first(reference, key)
    peaks = run.series("train_inner", "peak_mem_gb")
    assert len(peaks) == UPDATES
    assert all(kept > resharded for kept, resharded in zip(
        peaks, first(reference, "peak_mem_gb"), strict=True))
    assert "--no-reshard-after-forward: every unit stays gathered" in run.output
    assert "ignored under the plugin: --min-params-to-wrap" in run.output
    saved, expected = (torch.load(d / "checkpoint1.pt", weights_only=True)["model"]
                       for d in (tmp_path, reference_dir))
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[name], expected[name]) for name in saved)


def test_layers_per_unit_shards_layers_together_and_trains_the_same(
    corpus: Path, tmp_path: Path, sharded_tiny_run: tuple[RunResult, Path]
) -> None:
    """--layers-per-unit 2: each stack's two layers form one unit, sharded together as
    fairseq builds them; the same losses, norms and saved model as one unit per layer."""
    args = training_args(corpus, tmp_path, UPDATES) + TINY + [
        "--task", "sharded_translation", "--layers-per-unit", "2"]
    run = run_training(args, nproc=2, plugin=True)
    reference, reference_dir = sharded_tiny_run
    for key in ("loss", "gnorm"):
        assert run.series("train_inner", key) == first(reference, key)
    assert re.search(r"2 layer units \(encoder\.layers\.0-1 \.\.\. decoder\.layers\.0-1\)"
                     r".*\(2 layer units sharded as fairseq built them\)", run.output), (
        run.output[-3000:])
    assert "returned a view tensor" not in run.output  # silenced for grouped layers too
    saved, expected = (torch.load(d / "checkpoint1.pt", weights_only=True)["model"]
                       for d in (tmp_path, reference_dir))
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[name], expected[name]) for name in saved)


def error_line(run: RunResult) -> str:
    lines = [line for line in run.output.splitlines()
             if line.startswith("fairseq-shard-plugin: error: ")]
    assert run.returncode != 0 and lines, run.output[-3000:]
    return lines[0]


def resume_from(
    checkpoint_bytes: bytes, save_dir: Path, args: list[str], nproc: int = 2
) -> RunResult:
    save_dir.mkdir(parents=True, exist_ok=True)
    (save_dir / "checkpoint_last.pt").write_bytes(checkpoint_bytes)
    return run_training(args, nproc=nproc, plugin=True, check=False)


def test_truncated_checkpoint_fails_with_one_clear_line_and_is_kept(
    corpus: Path, sharded_tiny_run: tuple[RunResult, Path], tmp_path: Path
) -> None:
    whole = (sharded_tiny_run[1] / "checkpoint_last.pt").read_bytes()
    truncated = whole[: len(whole) // 2]
    run = resume_from(truncated, tmp_path,
                      training_args(corpus, tmp_path, REFERENCE_UPDATES + 5) + TINY)
    line = error_line(run)
    assert "checkpoint_last.pt: truncated checkpoint (" in line, line
    assert "miniz" not in line and line.endswith("SAVE_DIR lists them)"), line
    assert (tmp_path / "checkpoint_last.pt").read_bytes() == truncated  # nothing overwritten
    # the same file to fine-tune from: resuming from another file was the wrong advice
    source = tmp_path / "checkpoint_last.pt"
    run = run_training(training_args(corpus, tmp_path / "fine-tune", REFERENCE_UPDATES) + TINY
                       + ["--finetune-from-model", str(source)], nproc=1, plugin=True,
                       check=False)
    line = error_line(run)
    size = len(truncated)
    assert line.endswith(f"truncated checkpoint ({size} bytes: its end, the zip directory, "
                         "is missing); give --finetune-from-model an intact checkpoint "
                         "(fairseq-shard-verify FILE checks one)"), line


# Checkpoints of another architecture or vocabulary, damaged ones, exact reloads on other
# world sizes and exact resume: tests/test_checkpoints.py.


def test_training_resumed_on_four_ranks_continues(
    corpus: Path, sharded_tiny_run: tuple[RunResult, Path], tmp_path: Path
) -> None:
    run = resume_from((sharded_tiny_run[1] / "checkpoint_last.pt").read_bytes(), tmp_path,
                      training_args(corpus, tmp_path, REFERENCE_UPDATES + 10) + TINY, nproc=4)
    assert run.returncode == 0, run.output[-3000:]
    losses = run.series("train_inner", "loss")
    assert run.series("train_inner", "num_updates")[0] == REFERENCE_UPDATES + 1
    assert sum(losses[-3:]) / 3 < sharded_tiny_run[0].series("train_inner", "loss")[0]
    # 50 batches per rank on 2 ranks are 25 per rank on 4: past an epoch's half, fairseq
    # alone would stop with "dataloader mismatch"
    assert re.search(r"checkpoint saved on 2 ranks, resumed on 4: epoch \d+ continues after "
                     r"\d+ of its batches \((\d+) per rank then, (\d+) per rank now\)",
                     run.output), run.output[-3000:]


def test_the_place_in_the_epoch_is_converted_between_numbers_of_ranks() -> None:
    def state(position: int, ranks: int | None) -> dict:
        iterator = {"epoch": 2, "iterations_in_epoch": position, "shuffle": True}
        return {"train_iterator": iterator if ranks is None else dict(
            iterator, data_parallel_ranks=ranks)}

    for position, saved, now, expected in [(25, 2, 4, 12), (10, 4, 2, 20), (7, 3, 3, 7),
                                           (0, 2, 4, 0), (9, 1, 2, 4)]:
        extra_state = state(position, saved)
        said = convert_position(extra_state, now)
        assert extra_state["train_iterator"]["iterations_in_epoch"] == expected
        assert extra_state["train_iterator"]["data_parallel_ranks"] == now
        assert (said is None) == (saved == now or position == 0)
    stock = state(30, None)  # written by stock fairseq: no record of its ranks
    assert convert_position(stock, 4) is None and stock == state(30, None)
    record_ranks(stock, 2)
    assert stock["train_iterator"]["data_parallel_ranks"] == 2


def test_the_wrapped_training_entry_survives_fairseqs_own_spawn() -> None:
    """Without torchrun, fairseq-train on N GPUs spawns N processes and pickles ``main``
    (wrapped by the plugin for --export-consolidated) into each."""
    import pickle

    import fairseq_cli.train as train_cli

    from fairseq_shard_plugin.training.train_then_export import TrainThenExport

    unpickled = pickle.loads(pickle.dumps(TrainThenExport(train_cli.main)))
    assert unpickled.main is train_cli.main


def test_layers_are_sharded_as_fairseq_builds_them(
    sharded_tiny_run: tuple[RunResult, Path]
) -> None:
    """No rank holds the whole fp32 model at start: each of TINY's 2+2 layers was sharded
    as fairseq built it (its initialisation unchanged: the reference comparisons in this
    module and test_precision hold the same run to stock fairseq's)."""
    run, _ = sharded_tiny_run
    assert "(4 layer units sharded as fairseq built them)" in run.output
