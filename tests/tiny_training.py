"""The tiny model most tests train, and helpers the test modules share.

d 64, ffn 128, 2+2 pre-norm layers with all embeddings shared: big enough to have every
unit the wrap policy builds, small enough that a launch costs mostly process start-up.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from fairseq import checkpoint_utils, options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

from fairseq_shard_plugin.tasks import register
from launching.harness import REPO, start_ranks, transformer_args

TINY = transformer_args(dim=64, ffn=128, layers=2)
# fairseq's nllb branch (run by hand: CI has fairseq 0.12 only), where the tests that meet
# its documented differences (docs/nllb.md, "fairseq's nllb branch") account for them
ON_NLLB_BRANCH = hasattr(checkpoint_utils, "torch_load_cpu")
# The stock and sharded reference runs (conftest fixtures) train this many updates.
REFERENCE_UPDATES = 50
RESHARD_HELPER = REPO / "tests" / "helpers" / "reshard_checkpoints.py"
SHARDED = ("--checkpoint-format", "sharded")
# Validation that also translates (BLEU, and rank 0's first hypothesis of every batch logged).
EVAL_BLEU = ("--eval-bleu", "--eval-bleu-args", '{"beam": 1, "max_len_b": 10}',
             "--eval-bleu-detok", "space", "--eval-bleu-print-samples")


def sharded_config(corpus: Path, *flags: str) -> Any:
    """fairseq-train's configuration of a sharded TINY run with ``flags``, parsed by fairseq
    as its command line does; no process is started (for checks of the configuration).
    The plugin's tasks are registered first: fairseq skips a ``--user-dir`` whose package
    this process has imported already."""
    register()
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(corpus), *TINY, "--ddp-backend", "fully_sharded", *flags])
    return convert_namespace_to_omegaconf(args)


def relative_difference(a: list[float], b: list[float]) -> float:
    """Largest relative difference of two equally long series."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def reshard(nproc: int, corpus: Path, work: Path, spec: dict) -> dict:
    """Run ``helpers/reshard_checkpoints.py`` on ``nproc`` ranks; return its report."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "spec.json").write_text(json.dumps(spec))
    command = [sys.executable, str(RESHARD_HELPER),
               str(work / "report.json"), str(work / "spec.json"), str(corpus), *TINY,
               "--cpu", "--task", "sharded_translation", "--optimizer", "adam", "--lr", "1e-3",
               "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
               "--ddp-backend", "fully_sharded", *SHARDED, "--save-dir", str(work)]
    returncode, output = start_ranks(command, nproc, dict(os.environ, OMP_NUM_THREADS="1"),
                                     timeout=300)
    assert returncode == 0, output[-4000:]
    return json.loads((work / "report.json").read_text())


@contextlib.contextmanager
def one_rank_group(root: Path) -> Iterator[None]:
    """A one-rank gloo process group in this process (DCP's saves and loads are
    collective), unless one is up already; its store file under ``root``."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.FileStore(str(root / "store"), 1),
                                rank=0, world_size=1)
    try:
        yield
    finally:
        if started:
            dist.destroy_process_group()
