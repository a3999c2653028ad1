"""The README's own commands, as a user types them: torchrun starting fresh fairseq-train
processes that load the plugin by its relative user-dir name from the repository root, and
the console scripts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fairseq_shard_plugin.training.harmless_warnings import HARMLESS
from launching import forkserver
from launching.harness import (
    PLUGIN_DIR,
    REPO,
    rank_environment,
    run_command,
    run_concurrently,
    start_ranks,
    tool,
    training_args,
    transformer_args,
)

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)


def test_ranks_are_never_forked_on_a_machine_with_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(forkserver.ENABLE_VARIABLE, "1")
    script = [str(Path(rank_environment()["PATH"].split(":")[0]) / "fairseq-train")]
    assert forkserver.can_fork(script)
    monkeypatch.setattr(forkserver, "_has_cuda_device", lambda: True)
    assert not forkserver.can_fork(script)


def test_console_scripts_print_only_their_own_output(corpus: Path, tmp_path: Path) -> None:
    """No fairscale FutureWarning or fairseq tensorboardX notice before the script's lines."""
    checkpoint = tmp_path / "checkpoint_last.pt"
    checkpoint.write_bytes(b"not a checkpoint")
    finished = run_concurrently({
        "estimate": [tool("fairseq-shard-estimate"), "--world-size", "2", "--",
                     str(corpus), "--arch", "transformer", "--share-all-embeddings",
                     "--max-tokens", "512", "--optimizer", "adam"],
        "verify": [tool("fairseq-shard-verify"), str(tmp_path)],
        "consolidate": [tool("fairseq-shard-consolidate"), str(tmp_path), str(tmp_path / "o.pt")],
    })
    for name, done in finished.items():
        output = done.stdout + done.stderr
        assert "Warning" not in output and "tensorboardX" not in output, (name, output[:2000])
    assert finished["estimate"].returncode == 0
    assert finished["verify"].stdout.startswith(f"{checkpoint}: not a PyTorch checkpoint")
    assert finished["consolidate"].stderr.strip() == (
        f"fairseq-shard-consolidate: error: {checkpoint}: not a PyTorch checkpoint: the file "
        "starts with bytes 6e6f7420, neither a zip archive (torch.save since torch 1.6) nor "
        "the legacy pickle format")


def test_a_training_prints_none_of_fairseqs_own_deprecation_warnings(
    corpus: Path, tmp_path: Path
) -> None:
    """fairseq-train with the plugin: the Hydra and torch deprecation notices that fairseq's
    own calls trigger (training/harmless_warnings.py) are gone (fairscale's, printed at
    fairseq's import before the plugin loads, are not the plugin's to hide)."""
    args = training_args(corpus, tmp_path / "save", max_update=1, max_tokens=256)
    args += transformer_args(dim=32, ffn=64, layers=1, heads=2) + [
        "--no-save", "--disable-validation", "--user-dir", str(PLUGIN_DIR),
        "--task", "sharded_translation", "--ddp-backend", "fully_sharded"]
    code, output = start_ranks([tool("fairseq-train"), *args], 1, rank_environment())
    assert code == 0, output[-3000:]
    shown = [message for _, message, _ in HARMLESS
             if re.search(message.removeprefix(r"\s*"), output)]
    assert shown == [], shown
    assert "done training" in output


def test_the_readmes_walkthrough_runs_from_data_to_translations(tmp_path: Path) -> None:
    """README's "From data to translations" block, as it stands, its toy/ directory moved
    into a temporary one: data, training on 2 CPU ranks, verify, consolidate, and stock
    fairseq-generate on the export (no --user-dir) printing its BLEU line."""
    text = (REPO / "README.md").read_text()
    section = text.split("## From data to translations, on a CPU", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    # run from the repository root, it writes there: git leaves it alone
    if (REPO / ".git").exists():
        assert subprocess.run(["git", "check-ignore", "-q", "toy/"], cwd=REPO).returncode == 0
    script = re.sub(r"\btoy\b", str(tmp_path / "toy"), block)
    done = run_command(["bash", "-c", "set -eo pipefail\n" + script], cwd=REPO,
                       env=rank_environment(), timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "--user-dir" not in block.split("fairseq-generate", 1)[1]
    assert f"{tmp_path / 'toy' / 'checkpoints' / 'checkpoint_last.pt'}: ok (full" in done.stdout
    assert (tmp_path / "toy" / "model.pt").is_file()
    assert done.stdout.strip().splitlines()[-1].startswith("Generate test with beam=2: BLEU4 = ")
    assert "sharded over 2 ranks with fsdp2" in output
    assert "glibc's mmap threshold at 8 MiB (MALLOC_MMAP_THRESHOLD_): set by the plugin" in output
    # FSDP2's warning about views returned by fairseq's transformer classes (harmless: the
    # sharded losses and norms are stock's) no longer fills the screen
    assert "returned a view tensor" not in output


def test_the_configs_are_installed_and_named_from_anywhere(tmp_path: Path) -> None:
    """`--config-dir configs/nllb` worked only from the checkout, and `pip install .` left
    the configs behind (T1 #10, session 25): they are installed under PREFIX/share, and
    `fairseq-shard-user-dir --configs` names the checkout's or the installed copy."""
    from fairseq_shard_plugin.cli.user_dir import configs_folder

    printed = subprocess.run([tool("fairseq-shard-user-dir"), "--configs"], cwd=tmp_path,
                             check=True, capture_output=True, text=True).stdout.strip()
    assert Path(printed) == REPO / "configs" / "nllb"  # make's editable install: the checkout
    prefix = tmp_path / "prefix"
    # --ignore-installed: without it, pip uninstalls the environment's own (editable) copy
    done = run_command([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--no-build-isolation", "--ignore-installed", "--prefix", str(prefix),
                        str(REPO)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    package = next(prefix.glob("lib/python*/site-packages/fairseq_shard_plugin"))
    installed = configs_folder(package, prefix)
    assert installed == prefix / "share" / "fairseq-shard-plugin" / "configs" / "nllb"
    shipped = sorted(path.relative_to(REPO / "configs" / "nllb")
                     for path in (REPO / "configs" / "nllb").rglob("*.yaml"))
    assert sorted(path.relative_to(installed) for path in installed.rglob("*.yaml")) == shipped
    assert configs_folder(package, tmp_path / "elsewhere") is None


def test_the_user_dir_command_names_a_folder_fairseq_loads_from_anywhere(tmp_path: Path) -> None:
    """The README's `--user-dir "$(fairseq-shard-user-dir)"`, from a directory that is not
    the checkout (where `--user-dir fairseq_shard_plugin` names nothing for an editable
    install)."""
    printed = subprocess.run([tool("fairseq-shard-user-dir")], cwd=tmp_path, check=True,
                             capture_output=True, text=True).stdout.strip()
    assert (Path(printed) / "fairseq_integration.py").is_file()
    probe = ("import argparse, sys; from fairseq import utils; "
             f"utils.import_user_module(argparse.Namespace(user_dir={printed!r})); "
             "print('fairseq_shard_plugin.tasks.sharded_translation' in sys.modules)")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, check=True,
                            capture_output=True, text=True)
    assert loaded.stdout.strip().splitlines()[-1] == "True"
