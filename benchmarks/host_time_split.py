"""Where the host time of a world-size-1 update goes: FSDP2's hooks, the plugin's own code,
and the rest (fairseq, autograd, the operators), against stock fairseq.

The same training as ``benchmarks/dispatch_ops.py`` (12+12 layers at width 32, fp32, 512
tokens, so arithmetic is negligible and the time is Python and dispatch), one fresh process
per configuration. Named functions are wrapped with a clock that counts only the outermost
wrapped call (FSDP2's final backward callback runs the root's post-backward inside it), and
their time per update is the median over the updates after the warm-up.

    python -m benchmarks.host_time_split      # writes results/host_time_split.{md,json}
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.dispatch_ops import (
    WARMUP_UPDATES,
    activate_plugin_if_named,
    run_child,
    train_marking_updates,
)
from launching.harness import RESULTS

# (module, class, method) timed, by the part of the update they belong to
TIMED: dict[str, list[tuple[str, str, str]]] = {
    "FSDP2 hooks": [
        ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup", name)
        for name in ("pre_forward", "post_forward", "pre_backward", "post_backward")
    ] + [("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState",
          "_root_post_backward_final_callback")],
    "gradients dropped (zero_grad)": [("fairseq.trainer", "Trainer", "zero_grad")],
    "gradient norm": [("fairseq.trainer", "Trainer", "clip_grad_norm"),
                      ("fairseq_shard_plugin.training.trainer", "ShardedTrainer",
                       "clip_grad_norm")],
    "plugin: shards bound to the optimizer": [
        ("fairseq_shard_plugin.sharding.local_shards", "LocalShards", "bind")],
    "fairseq's Adam step": [("fairseq.optim.fairseq_optimizer", "FairseqOptimizer", "step")],
}
NAMES = ("stock legacy_ddp", "plugin fsdp2", "plugin fsdp2, 2 layers per unit",
         "plugin fsdp2, 4 layers per unit", "plugin fsdp2, one unit kept gathered")


class Clock:
    """Time per part, counting only the outermost wrapped call."""

    def __init__(self) -> None:
        self.depth = 0
        self.seconds: collections.Counter[str] = collections.Counter()

    def wrap(self, part: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.depth += 1
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.seconds[part] += time.perf_counter() - start
        return timed


def child(report: str, fairseq_args: list[str]) -> None:
    """In the measured process: fairseq-train's ``cli_main`` with the parts clocked, the
    clock read at the start of every update."""
    clock = Clock()
    activate_plugin_if_named(fairseq_args)
    for part, targets in TIMED.items():
        for module_name, class_name, method in targets:
            try:
                owner = getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError):
                continue
            if method in vars(owner):  # overridden here (a subclass calls the parent's)
                setattr(owner, method, clock.wrap(part, getattr(owner, method)))
    marks: list[tuple[float, dict[str, float]]] = []
    train_marking_updates(
        fairseq_args, lambda: marks.append((time.perf_counter(), dict(clock.seconds))),
        contextlib.nullcontext())
    steady = marks[WARMUP_UPDATES:]
    updates = [(b[0] - a[0], {part: b[1].get(part, 0.0) - a[1].get(part, 0.0) for part in TIMED})
               for a, b in zip(steady, steady[1:], strict=False)]
    Path(report).write_text(json.dumps(updates))


def measure(corpus: Path, work: Path, name: str, updates: int) -> dict[str, float]:
    """Milliseconds per update of each part (medians) for configuration ``name``."""
    found = run_child("benchmarks.host_time_split", corpus, work, name, updates, [], "split")
    row = {"update": 1000 * statistics.median(total for total, _ in found)}
    for part in TIMED:
        row[part] = 1000 * statistics.median(parts[part] for _, parts in found)
    row["the rest"] = row["update"] - sum(row[part] for part in TIMED)
    return row


def markdown(rows: dict[str, dict[str, float]], command: str) -> str:
    parts = ["update", *TIMED, "the rest"]
    lines = ["| ms per update | " + " | ".join(rows) + " |",
             "|---|" + "---|" * len(rows)]
    lines += [f"| {part} | " + " | ".join(f"{row[part]:.1f}" for row in rows.values()) + " |"
              for part in parts]
    lines += ["", "World size 1, fp32, 12+12 layers at width 32, 512 tokens per update, one "
              f"thread; medians over the updates after {WARMUP_UPDATES} of warm-up; a part's "
              "time counts its outermost calls only. Produced by "
              f"`{command}`.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--updates", type=int, default=16)
    args, rest = parser.parse_known_args()
    if args.child:
        child(args.child, rest[1:] if rest[:1] == ["--"] else rest)
        return
    from fairseq_shard_plugin.cli.synthetic_data import make_corpus

    with tempfile.TemporaryDirectory() as tmp:
        corpus = make_corpus(Path(tmp) / "corpus")
        rows = {name: measure(corpus, Path(tmp), name, args.updates) for name in NAMES}
    command = f"python -m benchmarks.host_time_split --updates {args.updates}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "host_time_split.json").write_text(json.dumps(rows, indent=1) + "\n")
    (RESULTS / "host_time_split.md").write_text(markdown(rows, command))
    print(markdown(rows, command))


if __name__ == "__main__":
    main()
