"""Unworkable configurations stop with one clear line before anything is written.

A few cases are real single-process ``fairseq-train`` runs, started all at once (the time
of a refusal is process start-up, which two cores can overlap); they show where the check
runs and what the user sees. The other options are checked in this process by the same
function (``validation.check_sharded_config``) on fairseq's own parse of the flags.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fairseq_shard_plugin.sharding.optimizer import is_element_wise
from fairseq_shard_plugin.sharding.precision import untie_bf16_from_tpu
from fairseq_shard_plugin.training.validation import (
    ShardingConfigError,
    check_sharded_config,
    ignored_fsdp_flags,
    unwritable_file,
)
from launching.harness import (
    PLUGIN_DIR,
    REPO,
    free_port,
    rank_environment,
    run_command,
    run_concurrently,
    tool,
    training_args,
    transformer_args,
)

from tiny_training import sharded_config

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)

TINY = transformer_args(dim=32, ffn=64, layers=1)
# launched: the line each prints names what to change
REFUSED = {
    "--amp": ["--amp"],
    "torchrun --nproc_per_node 2": ["--distributed-world-size", "2"],
    # the plugin's criterion under a stock backend: refused by its constructor, in one line
    "--loss-chunk-tokens 0: give at least 1": [
        "--ddp-backend", "legacy_ddp", "--task", "sharded_translation",
        "--criterion", "chunked_label_smoothed_cross_entropy", "--loss-chunk-tokens", "0"],
    # fairseq's probe of the save dir (hook 12) fails: Not a directory
    f"cannot write to the save dir {Path(__file__) / 'save'}: Not a directory (ENOTDIR)": [
        "--save-dir", str(Path(__file__) / "save")],
}
# refused once the model is built, before it trains (fairseq has made the save dir by then)
REFUSED_WITH_THE_MODEL = {
    # its bands run only for the tokens a batch holds: ranks gathered different units
    "--adaptive-softmax-cutoff (decoder.adaptive_softmax) runs each frequency band only for "
    "the tokens a batch holds": ["--adaptive-softmax-cutoff", "20"],
}
# checked in this process: the message names the flag
CHECKED = {
    "--store-ema": ["--store-ema"],
    "--quant-noise-pq rewrites weights inside forward": ["--quant-noise-pq", "0.1"],
    "--zero-sharding": ["--zero-sharding", "os"],
    "--base-layers": ["--base-layers", "1"],
    "--fp32-reduce-scatter and --reduce-in-16-bit": [
        "--task", "sharded_translation", "--fp32-reduce-scatter", "--reduce-in-16-bit"],
    "--save-on-signal: SIGFOO is not a signal": [
        "--task", "sharded_translation", "--save-on-signal", "usr1,foo"],
    "--restore-file /nowhere/model.pt: no such file": ["--restore-file", "/nowhere/model.pt"],
    # a directory: fairseq would find no checkpoint in it and train from scratch, exit 0
    f"--restore-file {Path(__file__).parent} is a directory (fairseq would train from "
    "scratch without a word): give a checkpoint file in it": [
        "--restore-file", str(Path(__file__).parent)],
    f"--finetune-from-model {Path(__file__).parent} is a directory": [
        "--finetune-from-model", str(Path(__file__).parent)],
    "--finetune-from-model /nowhere/nllb.pt: no such file: give the path of an existing "
    "checkpoint file": ["--finetune-from-model", "/nowhere/nllb.pt"],
    # fairseq's ValueErrors once the model was built, in a traceback
    f"--finetune-from-model {Path(__file__)} and --restore-file {Path(__file__)} name two "
    "checkpoints to start from: keep one": [
        "--finetune-from-model", str(Path(__file__)), "--restore-file", str(Path(__file__))],
    "--finetune-from-model resets the optimizer, learning rate schedule, meters and data "
    "position itself when it starts: remove --reset-optimizer, --reset-meters "
    "(checkpoint.reset_*)": [
        "--finetune-from-model", str(Path(__file__)), "--reset-optimizer", "--reset-meters"],
    "--memory-efficient-bf16 keeps the shards in 16 bits, which only --optimizer adam": [
        "--memory-efficient-bf16", "--optimizer", "sgd"],
    "--loss-chunk-tokens 0: give at least 1": [
        "--task", "sharded_translation", "--criterion", "chunked_label_smoothed_cross_entropy",
        "--loss-chunk-tokens", "0"],
    "--layers-per-unit 0: give 1 (every layer its own unit) or more": [
        "--task", "sharded_translation", "--layers-per-unit", "0"],
    # 2 % -1 == 0: every rank failed in the device mesh's shape, in a traceback
    "--shard-group-size -1: give the ranks of one shard group": [
        "--task", "sharded_translation", "--shard-strategy", "hybrid", "--shard-group-size",
        "-1"],
    "--update-freq 1,2 is a schedule: give --fp16-scale-window N": [
        "--fp16", "--update-freq", "1,2"],
    f"--export-consolidated {Path(__file__) / 'model.pt'}: {Path(__file__)} is not a "
    "directory": ["--task", "sharded_translation",
                  "--export-consolidated", str(Path(__file__) / "model.pt")],
    # a name too long for the file system: Path.is_dir() raised, a traceback of 25 lines
    f"--export-consolidated {Path(__file__).parent / ('m' * 300 + '.pt')}: File name too "
    "long (ENAMETOOLONG)": ["--task", "sharded_translation", "--export-consolidated",
                            str(Path(__file__).parent / ("m" * 300 + ".pt"))],
    # a name that fits, but not with the export's temporary file's suffix: failed after training
    "the name is too long for the export's temporary file beside it": [
        "--task", "sharded_translation", "--export-consolidated",
        str(Path(__file__).parent / ("m" * 240 + ".pt"))],
    # os.access says yes to root, which cannot create a file there: it trained, then failed
    "--export-consolidated /proc/model.pt: /proc does not take a new file": [
        "--task", "sharded_translation", "--export-consolidated", "/proc/model.pt"],
    # nor a directory (second audit: the ancestor was judged by os.access alone)
    "--export-consolidated /proc/new/model.pt: /proc does not take a new directory": [
        "--task", "sharded_translation", "--export-consolidated", "/proc/new/model.pt"],
    # a trailing separator means a directory: it wrote a file under the directory's name
    f"--export-consolidated {Path(__file__).parent / 'exports'}/: refused: it names a "
    "directory (it ends with a separator, . or ..)": [
        "--task", "sharded_translation", "--export-consolidated",
        f"{Path(__file__).parent / 'exports'}/"],
    # an export is weights only: a resume from it would restart at update 0
    "refused: fairseq resumes training from checkpoint_last*.pt": [
        "--task", "sharded_translation",
        "--export-consolidated", str(Path(__file__).parent / "checkpoint_last.pt")],
    "refused: checkpoint_1_20.pt is one of the training's own checkpoint names in "
    f"{Path(__file__).parent}": [
        "--task", "sharded_translation", "--save-dir", str(Path(__file__).parent),
        "--export-consolidated", str(Path(__file__).parent / "checkpoint_1_20.pt")],
}
ONE_RANK = ["--no-save"]
TYPO = "--keep-vocabulary-gatherd"
# the last update's save writes no file: no last checkpoint, no validation (no best), not
# at an epoch's end; the ranks must still agree on building the state (this hung before)
NOTHING_TO_WRITE = ["--task", "sharded_translation", "--no-last-checkpoints",
                    "--disable-validation"]


@pytest.fixture(scope="module")
def launches(
    corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every case's finished ``fairseq-train`` and its --save-dir, all run concurrently."""
    cases = dict(REFUSED, **REFUSED_WITH_THE_MODEL, one_rank=ONE_RANK, fairscale_shards=[],
                 nothing_to_write=NOTHING_TO_WRITE, typo=["--task", "sharded_translation", TYPO],
                 plugin_option_elsewhere=["--task", "translation", "--keep-vocabulary-gathered"],
                 criterion_option_elsewhere=["--task", "sharded_translation",
                                             "--loss-chunk-tokens", "0"],
                 no_close_choice=["--task", "sharded_translation", "--shard-strategy", "hsdp"],
                 too_long=["--task", "sharded_translation", "--max-tokens", "5"])
    save_dirs = {name: tmp_path_factory.mktemp("refused") / "save" for name in cases}
    save_dirs["fairscale_shards"].mkdir()
    (save_dirs["fairscale_shards"] / "checkpoint_last-shard0.pt").write_bytes(b"stock run")
    commands = {
        name: [tool("fairseq-train"), *training_args(corpus, save_dirs[name], 2), *TINY,
               "--user-dir", str(PLUGIN_DIR), "--ddp-backend", "fully_sharded", *extra]
        for name, extra in cases.items()}
    commands["typo on rank 1"] = ["env", "RANK=1", *commands["typo"]]
    commands["typo on srun's rank 1"] = ["env", "-u", "RANK", "SLURM_PROCID=1",
                                         *commands["typo"]]
    save_dirs["typo on rank 1"] = save_dirs["typo on srun's rank 1"] = save_dirs["typo"]
    for rank in (0, 1):  # as torchrun starts them: a worker's error file, its ranks
        for case in ("--amp", "typo"):
            name = f"{case} as torchrun's rank {rank}"
            error_file = save_dirs[case].parent / f"error{rank}.json"
            commands[name] = ["env", f"TORCHELASTIC_ERROR_FILE={error_file}", f"RANK={rank}",
                              f"LOCAL_RANK={rank}", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1",
                              "MASTER_PORT=29999", *commands[case]]
            save_dirs[name] = error_file
    # srun's ranks have no error file: srun may kill local rank 0 before it prints
    commands["--amp as srun's rank 1"] = [
        "env", "-u", "RANK", "SLURM_PROCID=1", "SLURM_LOCALID=1", "SLURM_NTASKS=2",
        "SLURM_NODELIST=localhost", "MASTER_PORT=29998", *commands["--amp"]]
    save_dirs["--amp as srun's rank 1"] = save_dirs["--amp"]
    finished = run_concurrently(commands)
    return {name: (finished[name], save_dirs[name]) for name in commands}


@pytest.mark.parametrize("names", [*REFUSED, *REFUSED_WITH_THE_MODEL])
def test_refused_before_training_with_the_flag_named(
    launches: dict[str, tuple[subprocess.CompletedProcess, Path]], names: str
) -> None:
    completed, save_dir = launches[names]
    assert completed.returncode != 0
    last_line = completed.stderr.strip().splitlines()[-1]
    assert last_line.startswith("fairseq-shard-plugin: error: ") and names in last_line
    assert "Traceback" not in completed.stderr, completed.stderr[-3000:]
    if names in REFUSED_WITH_THE_MODEL:  # fairseq made the save dir before the model
        assert not any(save_dir.iterdir())
    else:
        assert not save_dir.exists()


def test_a_sentence_longer_than_the_batches_is_one_line(
    launches: dict[str, tuple[subprocess.CompletedProcess, Path]],
) -> None:
    """fairseq's own assertion, 200 lines of traceback, as what to change."""
    completed, _ = launches["too_long"]
    assert completed.returncode != 0
    assert completed.stderr.strip().splitlines()[-1] == (
        "fairseq-shard-plugin: error: a sentence of the valid data is longer than the "
        "batches' 5 tokens (fairseq: Sentences lengths should not exceed max_tokens=5): raise "
        "--max-tokens (or --max-tokens-valid), or add --skip-invalid-size-inputs-valid-test "
        "to skip such sentences in validation")
    assert "Traceback" not in completed.stderr, completed.stderr[-3000:]


def test_a_mistyped_flag_is_one_line_naming_the_closest_option(
    launches: dict[str, tuple[subprocess.CompletedProcess, Path]]
) -> None:
    """Not fairseq's 186-line usage, once per rank: one line from rank 0 (hook 11)."""
    completed, _ = launches["typo"]
    assert completed.returncode == 2
    assert [line for line in completed.stderr.splitlines() if "error:" in line] == [
        f"fairseq-train: error: unrecognized arguments: {TYPO} "
        "(did you mean --keep-vocabulary-gathered?)"]
    assert "usage:" not in completed.stderr
    for other in ("typo on rank 1", "typo on srun's rank 1"):
        other_rank, _ = launches[other]
        assert other_rank.returncode == 2 and "error:" not in other_rank.stderr, other


@pytest.mark.parametrize("case", ["--amp", "typo"])
def test_torchrun_names_the_one_line_and_only_rank_zero_prints_it(
    launches: dict[str, tuple[subprocess.CompletedProcess, Path]], case: str
) -> None:
    """The same line from every rank, then torchrun's "Root Cause" block with a link to its
    docs: now one line a node, and the block names it (the worker's error file)."""
    lines = []
    for rank in (0, 1):
        completed, error_file = launches[f"{case} as torchrun's rank {rank}"]
        assert completed.returncode != 0
        printed = [text for text in completed.stderr.splitlines() if "error:" in text]
        assert len(printed) == (1 if rank == 0 else 0), completed.stderr[-2000:]
        recorded = json.loads(error_file.read_text())["message"]
        assert recorded["message"] == recorded["extraInfo"]["py_callstack"]
        lines.append(recorded["message"])
        if rank == 0:
            assert printed == [recorded["message"]]
    assert lines[0] == lines[1] and (case in lines[0] or TYPO in lines[0])
    if case == "--amp":
        completed, _ = launches["--amp as srun's rank 1"]
        assert completed.returncode != 0
        assert [text for text in completed.stderr.splitlines() if "error:" in text] == [
            lines[0]], completed.stderr[-2000:]


@pytest.mark.parametrize(("case", "line"), [
    ("plugin_option_elsewhere", "unrecognized arguments: --keep-vocabulary-gathered "
     "(--keep-vocabulary-gathered is an option of --task sharded_translation and "
     "sharded_translation_multi_simple_epoch)"),
    ("no_close_choice", "argument --shard-strategy: invalid choice: 'hsdp' (choose from "
     "'full', 'hybrid')"),
    ("criterion_option_elsewhere", "unrecognized arguments: --loss-chunk-tokens 0 "
     "(--loss-chunk-tokens is an option of --criterion chunked_label_smoothed_cross_entropy)")])
def test_a_flag_the_parser_refuses_is_explained_where_help_would_not(
    launches: dict[str, tuple[subprocess.CompletedProcess, Path]], case: str, line: str
) -> None:
    """It said "(fairseq-train --help lists them)", but fairseq's --help lists no option of a
    task, and argparse's own list of the choices was dropped."""
    completed, _ = launches[case]
    assert completed.returncode == 2
    assert [text for text in completed.stderr.splitlines() if "error:" in text] == [
        f"fairseq-train: error: {line}"]


@pytest.mark.parametrize("named", list(CHECKED))
def test_unworkable_options_are_named_in_one_line(corpus: Path, named: str) -> None:
    with pytest.raises(ShardingConfigError, match=re.escape(named)) as refused:
        check_sharded_config(sharded_config(corpus, "--cpu", "--optimizer", "adam",
                                            *CHECKED[named]))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("entry", ["checkpoint_last.pt", "checkpoint_last-shard0.pt",
                                   "checkpoint_shards"])
@pytest.mark.parametrize("kind", ["directory", "dangling link", "file"])
def test_what_the_save_dir_holds_under_its_own_names_is_checked_first(
    corpus: Path, tmp_path: Path, entry: str, kind: str
) -> None:
    """A directory or a dangling link as checkpoint_last.pt: fairseq trained from scratch
    and replaced the earlier run's checkpoint_best.pt, failing only at its last save; a
    file (or a dangling link) as checkpoint_shards failed only at the first save."""
    save_dir = tmp_path / "save"
    save_dir.mkdir()
    path = save_dir / entry
    if kind == "directory":
        path.mkdir()
    elif kind == "dangling link":
        path.symlink_to(tmp_path / "gone")
    else:
        path.write_bytes(b"not a directory")
    cfg = sharded_config(corpus, "--cpu", "--optimizer", "adam", "--task", "sharded_translation",
                         "--checkpoint-format", "sharded", "--save-dir", str(save_dir))
    acceptable = kind == ("directory" if entry == "checkpoint_shards" else "file")
    if acceptable:  # a checkpoint file, or the shards' directory
        check_sharded_config(cfg)
        return
    with pytest.raises(ShardingConfigError, match=f"^{re.escape(str(path))} is ") as refused:
        check_sharded_config(cfg)
    assert ("move it out of the save dir" in str(refused.value)
            or "sharded checkpoints keep their shards in that directory" in str(refused.value))


def test_fairseqs_default_backend_on_cpu_ranks_is_one_line(corpus: Path) -> None:
    """torchrun's 2 CPU ranks without --ddp-backend: the plugin's launcher setup (gloo,
    device 0) would reach DistributedDataParallel, which refuses CPU modules with device ids
    in a traceback on every rank; stock fairseq would train each rank alone."""
    from fairseq_shard_plugin.training.launch_env import apply_torchrun_environment
    from fairseq_shard_plugin.training.validation import check_any_backend

    cfg = sharded_config(corpus, "--cpu", "--ddp-backend", "pytorch_ddp")
    apply_torchrun_environment(cfg, {"WORLD_SIZE": "2", "RANK": "0",
                                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    with pytest.raises(ShardingConfigError, match=re.escape(
            "--ddp-backend pytorch_ddp (fairseq's default) cannot train on CPU ranks")):
        check_any_backend(cfg)
    cfg.distributed_training.ddp_backend = "legacy_ddp"
    check_any_backend(cfg)


def test_plugin_options_without_effect_in_the_run_are_named(
    corpus: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    from fairseq_shard_plugin.sharding.settings import ShardingSettings
    from fairseq_shard_plugin.training.trainer import _log_flags_taken_over

    cfg = sharded_config(corpus, "--cpu", "--task", "sharded_translation", "--optimizer",
                         "adam", "--reduce-in-16-bit", "--shard-group-size", "3",
                         "--root-unit-only", "--layers-per-unit", "2",
                         "--keep-vocabulary-gathered", "--no-host-step-overlap")
    with caplog.at_level(logging.WARNING):
        _log_flags_taken_over(cfg, ShardingSettings.from_config(cfg, 1, False))
    assert [record.getMessage() for record in caplog.records
            if record.name.startswith("fairseq_shard_plugin")] == [
        "--reduce-in-16-bit has no effect in an fp32 run (its gradients are fp32): add --fp16 "
        "or --bf16, or remove it",
        "--shard-group-size 3 has no effect without --shard-strategy hybrid: this run shards "
        "fully over all its ranks",
        "--layers-per-unit 2 has no effect with --root-unit-only (there are no layer units): "
        "remove one of them",
        "--keep-vocabulary-gathered has no effect with --root-unit-only (there is no "
        "vocabulary unit: the root holds the vocabulary): remove one of them",
        "--no-host-step-overlap has no effect without --cpu-offload (the optimizer steps on "
        "the device): remove it"]


def test_use_sharded_state_is_taken_as_the_sharded_format(corpus: Path) -> None:
    """fairseq's --use-sharded-state (its recipes pass it): the plugin's sharded format,
    fairseq's flag cleared (its `-shard0` file names never used); with a format or engine
    that contradicts it, one line."""
    from fairseq_shard_plugin.sharding.options import checkpoint_format, take_use_sharded_state

    def config(*flags: str) -> Any:
        return sharded_config(corpus, "--cpu", "--optimizer", "adam", "--use-sharded-state",
                              *flags)

    for task in ([], ["--task", "sharded_translation"]):  # a stock task's config too
        cfg = config(*task)
        assert take_use_sharded_state(cfg)
        assert checkpoint_format(cfg) == "sharded"
        assert not cfg.distributed_training.use_sharded_state
    contradictions = {"--checkpoint-format full": ["--checkpoint-format", "full"],
                      "--shard-engine fsdp2": ["--shard-engine", "fairscale"]}
    for named, flags in contradictions.items():
        with pytest.raises(ShardingConfigError, match=re.escape(named)) as refused:
            take_use_sharded_state(config("--task", "sharded_translation", *flags))
        assert "\n" not in str(refused.value)


def test_stock_fsdp_flags_the_plugin_does_not_use_are_named(corpus: Path) -> None:
    """Recipes carry fairseq's fairscale flags: the unused ones are logged, not refused."""
    def ignored(*flags: str) -> list[str]:
        return ignored_fsdp_flags(sharded_config(corpus, "--cpu", "--optimizer", "adam", *flags))

    assert ignored() == []
    assert ignored("--min-params-to-wrap", str(int(1e8))) == []  # the NLLB sweeps' value
    named = ignored("--min-params-to-wrap", "0", "--not-fsdp-flatten-parameters")
    assert [flag.split()[0] for flag in named] == ["--min-params-to-wrap",
                                                   "--not-fsdp-flatten-parameters"]


def test_unknown_engine_is_refused_by_the_flag_parser(
    corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        sharded_config(corpus, "--task", "sharded_translation", "--shard-engine", "deepspeed")
    assert "--shard-engine: invalid choice: 'deepspeed'" in capsys.readouterr().err


def test_single_process_without_torchrun_trains_on_a_one_rank_group(
    launches: dict[str, tuple[subprocess.CompletedProcess, Path]],
) -> None:
    completed, _ = launches["one_rank"]
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "sharded over 1 ranks with fsdp2" in completed.stdout + completed.stderr


def test_a_save_that_writes_no_file_does_not_leave_a_rank_waiting(
    launches: dict[str, tuple[subprocess.CompletedProcess, Path]],
) -> None:
    completed, save_dir = launches["nothing_to_write"]
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert not save_dir.exists() or not list(save_dir.iterdir())


def test_checkpoints_of_fairseqs_own_fully_sharded_are_not_silently_skipped(
    launches: dict[str, tuple[subprocess.CompletedProcess, Path]],
) -> None:
    """fairseq's fairscale path saves checkpoint_last-shard0.pt, ...; the plugin continues
    from them (test_stock_sharded_state.py), so a damaged one is named, not skipped for a
    fresh start."""
    completed, save_dir = launches["fairscale_shards"]
    assert completed.returncode != 0
    last_line = completed.stderr.strip().splitlines()[-1]
    assert last_line.startswith("fairseq-shard-plugin: error: ")
    assert "checkpoint_last-shard0.pt: not a PyTorch checkpoint" in last_line
    assert [f.name for f in save_dir.iterdir()] == ["checkpoint_last-shard0.pt"]


EXPORT_AFTER_A_DAMAGED_SAVE = """
import sys
sys.path[:0] = [".", "tests"]
import fairseq.distributed.utils as distributed_utils
import fairseq_shard_plugin
from tiny_training import sharded_config

fairseq_shard_plugin.activate()
corpus, save_dir, out = sys.argv[1:]
cfg = sharded_config(corpus, "--task", "sharded_translation", "--user-dir", "fairseq_shard_plugin",
                     "--cpu", "--max-tokens", "512", "--save-dir", save_dir,
                     "--optimizer", "adam", "--export-consolidated", out)

def training_whose_last_save_was_damaged(cfg, **kwargs):
    with open(f"{save_dir}/checkpoint_last.pt", "wb") as file:
        file.write(b"half a checkpoint")

distributed_utils.call_main(cfg, training_whose_last_save_was_damaged)
"""


def test_a_damaged_checkpoint_at_the_end_of_training_export_ends_in_one_line(
    corpus: Path, tmp_path: Path
) -> None:
    """Hook 4 exports checkpoint_last.pt after training; every error of the plugin's family
    (here the export's ConsolidateError) ends the run in one line, not a traceback. Only the
    training is stood in for: the launch, the export and its error are the plugin's."""
    done = run_command(
        [sys.executable, "-c", EXPORT_AFTER_A_DAMAGED_SAVE, str(corpus), str(tmp_path),
         str(tmp_path / "model.pt")])
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"fairseq-shard-plugin: error: {tmp_path}/checkpoint_last.pt: "), last
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "model.pt").exists()


def test_the_export_paths_probe_leaves_its_directory_as_it_was(tmp_path: Path) -> None:
    """The probe's file is new and removed at once; an existing target is not touched, and
    directories the export would create are not created by the check."""
    existing = tmp_path / "model.pt"
    existing.write_bytes(b"weights")
    before = existing.stat()
    assert unwritable_file(str(existing)) is None
    assert list(tmp_path.iterdir()) == [existing]
    after = existing.stat()
    assert (after.st_ino, after.st_mtime_ns, existing.read_bytes()) == (
        before.st_ino, before.st_mtime_ns, b"weights")
    assert unwritable_file(str(tmp_path / "new" / "sub" / "model.pt")) is None
    assert list(tmp_path.iterdir()) == [existing]


def test_an_export_path_under_a_dangling_link_is_refused_before_training(
    tmp_path: Path
) -> None:
    """A parent that is a link to nothing was climbed over (Path.exists() is False for it):
    the check passed and the export failed after training with EEXIST (the third audit)."""
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    for target in ("dangling/model.pt", "dangling/sub/model.pt"):
        assert unwritable_file(str(tmp_path / target)) == (
            f"{tmp_path / 'dangling'} is a link to nothing ({tmp_path / 'gone'})"), target
    assert sorted(path.name for path in tmp_path.iterdir()) == ["dangling"]


def test_an_unsupported_optimizer_is_named_before_the_precision_it_came_with(
    corpus: Path,
) -> None:
    """``--optimizer adam8bit`` (nllb branch) with --memory-efficient-fp16: the refusal names
    adam8bit itself, not a precision flag that would lead to the same refusal next."""
    cfg = sharded_config(corpus, "--cpu", "--optimizer", "adam", "--memory-efficient-fp16")
    cfg.optimizer._name = "adam8bit"  # the branch's optimizer, as its parser sets it
    with pytest.raises(ShardingConfigError) as refused:
        check_sharded_config(cfg)
    assert str(refused.value).startswith("--optimizer adam8bit is not supported")
    assert "use --optimizer adam" in str(refused.value)


@pytest.mark.parametrize("sixteen_bit", ["fp16", "bf16"])
def test_a_16_bit_optimizer_refusal_advises_only_what_the_plugin_runs(
    corpus: Path, sixteen_bit: str,
) -> None:
    """issue 31 item 4: ``--memory-efficient-fp16 --optimizer adafactor`` advised --fp16 with
    adafactor, which was then refused as not element-wise: adafactor is refused first, and
    the optimizers it names pass with the precision named beside them."""
    with pytest.raises(ShardingConfigError) as refused:
        check_sharded_config(sharded_config(corpus, "--cpu", "--optimizer", "adafactor",
                                            f"--memory-efficient-{sixteen_bit}"))
    line = str(refused.value)
    assert line == (
        "--optimizer adafactor is not element-wise, so its sharded state would differ from "
        f"unsharded training: use adam (fairseq's is AdamW) with --memory-efficient-"
        f"{sixteen_bit}, or sgd, nag, adadelta, adamax or adagrad with --{sixteen_bit} (fp32 "
        "master shards) with --ddp-backend fully_sharded")
    advised = [("adam", f"--memory-efficient-{sixteen_bit}")] + [
        (optimizer, f"--{sixteen_bit}")
        for optimizer in ("sgd", "nag", "adadelta", "adamax", "adagrad")]
    for optimizer, precision in advised:
        cfg = sharded_config(corpus, "--cpu", "--optimizer", optimizer, precision)
        untie_bf16_from_tpu(cfg)  # as the plugin does (fairseq's parser implies --tpu)
        check_sharded_config(cfg)
        assert is_element_wise(cfg.optimizer), optimizer  # as the optimizer's build checks


def test_a_wrong_data_path_is_named_with_the_one_to_give(corpus: Path, tmp_path: Path) -> None:
    """fairseq-shard-synthetic-data OUT writes OUT/raw and OUT/bin: passing OUT (or a path
    that does not exist) is said in one line, not "Could not infer language pair"."""
    def train(data: Path, *batch: str) -> list[str]:
        return [tool("fairseq-train"), str(data), "--cpu", "--user-dir", str(PLUGIN_DIR),
                "--task", "sharded_translation", "--ddp-backend", "fully_sharded",
                "--arch", "transformer", "--optimizer", "adam", *batch,
                "--save-dir", str(tmp_path / f"save-{data.name}")]

    tokens = ("--max-tokens", "512")
    finished = run_concurrently({"out": train(corpus.parent, *tokens),
                                 "nowhere": train(tmp_path / "x", *tokens),
                                 # relative: to where? (Hydra's run dir changes it, T1 #4)
                                 "relative": train(Path("toy/bin"), *tokens),
                                 "no batch size": train(corpus),
                                 "no optimizer": [word for word in train(corpus, *tokens)
                                                  if word not in ("--optimizer", "adam")]})
    for name, said in (("out", f"the data directory {corpus.parent} holds the binarised data "
                               f"in {corpus}: pass {corpus}"),
                       ("nowhere", f"the data directory {tmp_path / 'x'}: no such directory: "),
                       ("relative", f"the data directory toy/bin: no such directory in {REPO}, "
                                    "the working directory: "),
                       ("no batch size", "give --max-tokens N"),
                       ("no optimizer", "give --optimizer (adam for the NLLB recipe")):
        done = finished[name]
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert done.stderr.strip().splitlines()[-1].startswith(
            f"fairseq-shard-plugin: error: {said}"), done.stderr[-500:]


def test_a_mistake_every_rank_meets_in_training_is_printed_once_under_torchrun(
    corpus: Path, tmp_path: Path
) -> None:
    """A wrong DATA (found when the task is set up) and a refused optimizer (found when the
    trainer builds it) were printed by every rank, above torchrun's summary that names each
    rank's line again (issue 29 #5); the mistake is now printed by the node's first rank."""
    def torchrun(name: str, data: Path) -> list[str]:
        return [tool("torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
                tool("fairseq-train"), *training_args(data, tmp_path / name, 2), *TINY,
                "--user-dir", str(PLUGIN_DIR), "--task", "sharded_translation",
                "--ddp-backend", "fully_sharded"]

    adafactor = torchrun("optimizer", corpus)
    betas = adafactor.index("--adam-betas")
    del adafactor[betas:betas + 2]
    adafactor[adafactor.index("adam")] = "adafactor"
    finished = run_concurrently({"data": torchrun("data", corpus.parent),
                                 "optimizer": adafactor})
    for name, said in (("data", f"the data directory {corpus.parent} holds the binarised "
                                f"data in {corpus}: pass {corpus}"),
                       ("optimizer", "--optimizer adafactor is not element-wise")):
        done = finished[name]
        # torchrun's own traceback (its agent raises ChildFailedError), none of a rank's
        assert done.returncode != 0 and done.stderr.count("Traceback") == 1, done.stderr[-3000:]
        printed = [line for line in done.stderr.splitlines()
                   if line.startswith("fairseq-shard-plugin: error: ")]
        assert len(printed) == 1 and said in printed[0], done.stderr[-3000:]
        # torchrun's summary still names it for both ranks (their error files)
        assert done.stderr.count(f"traceback : {printed[0]}") == 2, done.stderr[-3000:]


def test_a_restore_file_named_as_in_the_save_dir_is_pointed_there(corpus: Path,
                                                                  tmp_path: Path) -> None:
    """fairseq reads --restore-file from the working directory: a name of the save dir's own
    checkpoints was "no such file" without saying where it is (lifeT #5)."""
    save_dir = tmp_path / "save"
    save_dir.mkdir()
    (save_dir / "checkpoint_2_20.pt").write_bytes(b"")
    cfg = sharded_config(corpus, "--cpu", "--optimizer", "adam", "--save-dir", str(save_dir),
                         "--restore-file", "checkpoint_2_20.pt")
    with pytest.raises(ShardingConfigError, match=re.escape(
            f"--restore-file checkpoint_2_20.pt: no such file: give "
            f"{save_dir / 'checkpoint_2_20.pt'} (--restore-file is read from the working "
            "directory, not the save dir)")):
        check_sharded_config(cfg)


def test_an_error_line_that_cannot_be_printed_still_ends_the_run_with_status_1(
    tmp_path: Path
) -> None:
    """stderr on a full disk: printing the line failed (EFBIG), and the OSError, not the
    exit status, left the run, through fairseq and torch's rank-prefixing excepthook
    (which raised too); torchrun's error file still gets the line."""
    error_file = tmp_path / "error.json"
    script = """
import resource, signal, sys
from fairseq_shard_plugin.errors import exit_with
print("x" * 5000, file=sys.stderr, flush=True)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    exit_with("fairseq-shard-plugin: error: the disk is full")
except SystemExit as exiting:
    print("the exit status was raised", exiting.code, flush=True)
    raise
"""
    with open(tmp_path / "stderr", "wb") as stderr:
        done = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              stderr=stderr, text=True, timeout=120, cwd=REPO,
                              env={**rank_environment(), "TORCHELASTIC_ERROR_FILE":
                                   str(error_file)})
    assert done.returncode == 1 and "the exit status was raised 1" in done.stdout, done
    message = json.loads(error_file.read_text())["message"]["message"]
    assert message == "fairseq-shard-plugin: error: the disk is full"
