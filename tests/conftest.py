"""Shared fixtures: a small synthetic corpus, binarised once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fairseq_shard_plugin.synthetic_corpus import make_corpus  # noqa: E402


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Binarised synthetic translation data (joined dictionary of ~600 types)."""
    return make_corpus(tmp_path_factory.mktemp("corpus"))
