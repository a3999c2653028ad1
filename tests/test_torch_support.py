"""A torch older than the plugin supports is refused in one line, at import, before anything
fails inside FSDP2 or a checkpoint write (by hand, 2026-12-06: torch 2.6.0 from PyPI failed
with "No module named 'torch.utils.serialization'" before this check, and FSDP2 on CPU ranks
with "'Stream' object has no attribute 'record_event'")."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fairseq_shard_plugin.torch_support import OLDEST_TORCH, installed_torch, torch_problem
from launching.harness import REPO


@pytest.mark.parametrize(("version", "refused"), [
    ("2.6.0", True), ("2.10.1+cu128", True), ("1.13.1", True),
    ("2.11.0", False), ("2.11.0+cu130", False), ("2.13.0+cpu", False),
    ("2.16.0a0+git1234abc", False), ("3.0.0", False),
    ("unknown", False),  # importable, no distribution metadata (a source build)
])
def test_only_releases_older_than_the_oldest_supported_are_refused(
    version: str, refused: bool
) -> None:
    problem = torch_problem(version)
    assert (problem is not None) == refused
    if refused:
        assert problem.startswith(f"torch {version} is older than 2.11")
        assert "upgrade torch to >= 2.11" in problem


def test_no_torch_at_all_says_to_install_it() -> None:
    assert torch_problem(None) == ("torch is not installed: install torch >= 2.11 first "
                                   "(pip install torch)")


def test_this_environment_passes() -> None:
    assert OLDEST_TORCH == (2, 11)
    assert torch_problem(installed_torch()) is None


def test_the_package_stops_in_one_line_on_an_older_torch(tmp_path: Path) -> None:
    """The installed distribution's metadata decides (no torch import): a torch 2.6.0
    distribution found first on the path is what importlib.metadata reports."""
    info = tmp_path / "torch-2.6.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.6.0\n")
    error_file = tmp_path / "error.json"
    done = subprocess.run(
        [sys.executable, "-c", "import fairseq_shard_plugin"], cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tmp_path}:{REPO}",
             "TORCHELASTIC_ERROR_FILE": str(error_file)},
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "fairseq-shard-plugin: error: torch 2.6.0 is older than 2.11, the oldest release the "
        "plugin runs on (its FSDP2 and checkpoint writer need it): upgrade torch to >= 2.11 "
        "(with its matching CUDA build), or use a stock --ddp-backend without the plugin"]
    assert "torch 2.6.0 is older than 2.11" in error_file.read_text()  # torchrun's summary


@pytest.mark.parametrize(("version", "flags", "refused"), [
    ("2.11.0+cu130", [], True), ("2.12.1", [], True),
    ("2.11.0+cu130", ["--disable-validation"], False), ("2.13.0+cpu", [], False),
])
def test_validation_through_the_chunked_loss_is_refused_where_torch_fails_it(
    tmp_path: Path, version: str, flags: list[str], refused: bool
) -> None:
    """torch 2.11's FSDP2 failed the first validation through the chunked loss, after the
    epoch's training (by hand, 2026-12-06: "aten.embedding.default got mixed torch.Tensor
    and DTensor"); the run stops before training instead."""
    from fairseq_shard_plugin.errors import ShardingConfigError
    from fairseq_shard_plugin.training.validation import check_chunked_validation

    from tiny_training import sharded_config

    cfg = sharded_config(tmp_path, "--criterion", "chunked_label_smoothed_cross_entropy",
                         *flags)
    if not refused:
        check_chunked_validation(cfg, version)
        return
    expected = (f"fails inside torch {re.escape(version)}'s FSDP2 at the first validation "
                r"\(checked: 2.11 fails, 2.13 works\): add --disable-validation")
    with pytest.raises(ShardingConfigError, match=expected):
        check_chunked_validation(cfg, version)
