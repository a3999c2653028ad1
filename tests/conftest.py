"""Session fixtures: synthetic corpora, and the stock and sharded reference trainings that
several test modules compare against (launched once per test session)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness import RunResult, run_training, training_args  # noqa: E402
from fairseq_shard_plugin.checkpoint.safe_loading import (  # noqa: E402
    allow_fairseq_checkpoint_types,
)
from fairseq_shard_plugin.cli.synthetic_data import make_corpus  # noqa: E402

from tiny_training import EVAL_BLEU, REFERENCE_UPDATES, TINY  # noqa: E402

LANGUAGES = ("eng_Latn", "fra_Latn", "deu_Latn")

# Tests read fairseq checkpoints with torch.load(weights_only=True), as the plugin does.
allow_fairseq_checkpoint_types()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Binarised synthetic translation data (joined dictionary of ~600 types)."""
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def multilingual(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Binarised synthetic data in NLLB's layout: directions between LANGUAGES, langs.txt."""
    out = tmp_path_factory.mktemp("multilingual")
    subprocess.run([sys.executable, "-m", "fairseq_shard_plugin.cli.synthetic_data", str(out),
                    "--languages", ",".join(LANGUAGES), "--train", "600", "--valid", "50"],
                   check=True, capture_output=True)
    return out / "bin"


@pytest.fixture(scope="session")
def stock_tiny_run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """Stock fairseq (legacy_ddp, no plugin) training TINY on 2 ranks: the fp32 reference;
    its validations translate too (BLEU)."""
    save_dir = tmp_path_factory.mktemp("stock_tiny")
    args = training_args(corpus, save_dir, REFERENCE_UPDATES) + TINY + [*EVAL_BLEU]
    return run_training(args, nproc=2, plugin=False)


@pytest.fixture(scope="session")
def sharded_tiny_run(
    corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[RunResult, Path]:
    """The same training with the plugin (fully_sharded, fp32); its save dir."""
    save_dir = tmp_path_factory.mktemp("sharded_tiny")
    args = training_args(corpus, save_dir, REFERENCE_UPDATES) + TINY + [
        "--task", "sharded_translation", *EVAL_BLEU]
    return run_training(args, nproc=2, plugin=True), save_dir
