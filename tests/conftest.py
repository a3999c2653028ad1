"""Shared fixtures: a small synthetic corpus, binarised once per test session."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fairseq_shard_plugin.synthetic_corpus import make_corpus  # noqa: E402

LANGUAGES = ("eng_Latn", "fra_Latn", "deu_Latn")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Binarised synthetic translation data (joined dictionary of ~600 types)."""
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def multilingual(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Binarised synthetic data in NLLB's layout: directions between LANGUAGES, langs.txt."""
    out = tmp_path_factory.mktemp("multilingual")
    subprocess.run([sys.executable, "-m", "fairseq_shard_plugin.synthetic_corpus", str(out),
                    "--languages", ",".join(LANGUAGES), "--train", "600", "--valid", "50"],
                   check=True, capture_output=True)
    return out / "bin"
