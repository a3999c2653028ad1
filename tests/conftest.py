"""Session fixtures: synthetic corpora, and the stock and sharded reference trainings that
several test modules compare against (launched once per test session)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fairseq_shard_plugin.checkpoint.safe_loading import (  # noqa: E402
    allow_fairseq_checkpoint_types,
)
from fairseq_shard_plugin.cli.synthetic_data import make_corpus  # noqa: E402
from launching.harness import (  # noqa: E402
    RunResult,
    in_threads,
    result_of,
    run_command,
    run_training,
    training_args,
)

from tiny_training import EVAL_BLEU, REFERENCE_UPDATES, TINY  # noqa: E402

LANGUAGES = ("eng_Latn", "fra_Latn", "deu_Latn")

# Ranks start as forks of a Python that has imported fairseq (launching/forkserver.py):
# the same processes, without each one's 3.5 s of imports. FAIRSEQ_SHARD_TEST_FORKSERVER=0
# launches every rank as a fresh process instead.
os.environ.setdefault("FAIRSEQ_SHARD_TEST_FORKSERVER", "1")

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
    made = run_command([sys.executable, "-m", "fairseq_shard_plugin.cli.synthetic_data",
                        str(out), "--languages", ",".join(LANGUAGES), "--train", "600",
                        "--valid", "50"])
    assert made.returncode == 0, made.stderr[-3000:]
    return out / "bin"


@pytest.fixture(scope="session")
def reference_runs(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The stock and the sharded reference trainings, launched together (each is 2 ranks
    of the same small training; nothing they are compared on depends on timing)."""
    stock_dir = tmp_path_factory.mktemp("stock_tiny")
    sharded_dir = tmp_path_factory.mktemp("sharded_tiny")
    stock = training_args(corpus, stock_dir, REFERENCE_UPDATES) + TINY + [*EVAL_BLEU]
    sharded = training_args(corpus, sharded_dir, REFERENCE_UPDATES) + TINY + [
        "--task", "sharded_translation", *EVAL_BLEU]
    runs = in_threads({
        "stock": lambda: run_training(stock, nproc=2, plugin=False),
        "sharded": lambda: (run_training(sharded, nproc=2, plugin=True), sharded_dir),
    })
    return {name: result_of(runs, name) for name in runs}


@pytest.fixture(scope="session")
def stock_tiny_run(reference_runs: dict[str, object]) -> RunResult:
    """Stock fairseq (legacy_ddp, no plugin) training TINY on 2 ranks: the fp32 reference;
    its validations translate too (BLEU)."""
    return reference_runs["stock"]  # type: ignore[return-value]


@pytest.fixture(scope="session")
def sharded_tiny_run(reference_runs: dict[str, object]) -> tuple[RunResult, Path]:
    """The same training with the plugin (fully_sharded, fp32); its save dir."""
    return reference_runs["sharded"]  # type: ignore[return-value]
