"""Host work per training step, the plugin against stock fairseq: a CPU proxy for GPU speed.

On a GPU at NLLB sizes every aten operation is at least one kernel launch and a few
microseconds of Python and dispatcher time on the host; when the host cannot issue them as
fast as the GPU runs them, the step is launch-bound. Two measurements need no GPU:

1. **Operations per update**: every aten operation dispatched during a training run is
   counted (a ``TorchDispatchMode`` around fairseq's ``cli_main``), and the counter is read
   each time fairseq's ``Trainer.train_step`` starts: the count between two starts is
   everything one update dispatched (forward, backward, optimizer, logging). The median over
   the updates after a warm-up is reported, with the operations that differ most from stock.
2. **Host time per update** on a model whose arithmetic is negligible (width 32, so the time
   is Python, dispatch and bookkeeping): the median time between the starts of consecutive
   updates after the warm-up, in runs without the counting mode, one configuration at a time.

World size 1 (one process; FSDP2 still does its copy-in and copy-out), fp32, 12+12 layers at
width 32, as in issue 28's first count (which counted whole runs of 8 and 4 updates: stock
6,541 operations per update, the plugin 8,113, 1.24x; this count, read at each update,
gives larger totals and the same ratio before the gradient-norm change: 1.25x).

``--meter`` measures instead what ``fairseq-shard-measure-train``'s live-tensor meter adds
to the host time per update (``results/meter_cost.md``).

    python -m benchmarks.dispatch_ops            # writes results/dispatch_ops.{md,json}
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launching.harness import (
    PLUGIN_DIR,
    RESULTS,
    in_threads,
    rank_environment,
    result_of,
    start_ranks,
    training_args,
    transformer_args,
)

WARMUP_UPDATES = 3
MODEL = transformer_args(dim=32, ffn=64, layers=12, heads=2)
# what each configuration adds to the same training command
CONFIGS: dict[str, list[str]] = {
    "stock legacy_ddp": ["--ddp-backend", "legacy_ddp"],
    "plugin fsdp2": ["--user-dir", str(PLUGIN_DIR), "--task", "sharded_translation",
                     "--ddp-backend", "fully_sharded", "--no-memory-report"],
    "plugin fsdp2 --bf16": ["--user-dir", str(PLUGIN_DIR), "--task", "sharded_translation",
                            "--ddp-backend", "fully_sharded", "--no-memory-report", "--bf16"],
    # consecutive layers sharded together: fewer units, so fewer hooks and collectives
    **{f"plugin fsdp2, {n} layers per unit": [
        "--user-dir", str(PLUGIN_DIR), "--task", "sharded_translation", "--ddp-backend",
        "fully_sharded", "--no-memory-report", "--layers-per-unit", str(n)] for n in (2, 4)},
    # one unit, gathered from forward to backward: FSDP2's hooks once per pass, and no
    # copies in backward (at world size 1 there is nothing to shard; costs one gathered copy)
    "plugin fsdp2, one unit kept gathered": [
        "--user-dir", str(PLUGIN_DIR), "--task", "sharded_translation", "--ddp-backend",
        "fully_sharded", "--no-memory-report", "--root-unit-only", "--no-reshard-after-forward"],
}


# what `python -m benchmarks.dispatch_ops` compares (results/dispatch_ops.md); the layers-per-
# unit configurations are host_time_split's
TABLE = tuple(name for name in CONFIGS if "layers per unit" not in name)


def child(report: str, fairseq_args: list[str], count: bool, meter: bool = False) -> None:
    """In the measured process: run fairseq-train's ``cli_main`` on ``fairseq_args``,
    counting dispatched operations between the starts of consecutive updates."""
    import torch  # noqa: F401  (before fairseq, as fairseq-train does)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.total = 0
            self.by_op: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            self.total += 1
            self.by_op[str(func)] += 1
            return func(*args, **(kwargs or {}))

    mode = Counting()
    marks: list[tuple[int, collections.Counter[str], float]] = []

    def mark() -> None:
        marks.append((mode.total, collections.Counter(mode.by_op) if count else None,
                      time.perf_counter()))

    around: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if count:
        around = mode
    elif meter:  # as fairseq-shard-measure-train ran every row of the first GPU check
        from fairseq_shard_plugin.memory.meters import LiveTensorMeter

        activate_plugin_if_named(fairseq_args)
        around = LiveTensorMeter()
    train_marking_updates(fairseq_args, mark, around)
    per_update = [b[0] - a[0] for a, b in zip(marks, marks[1:], strict=False)]
    seconds = [b[2] - a[2] for a, b in zip(marks, marks[1:], strict=False)]
    steady = marks[WARMUP_UPDATES:]
    ops: dict[str, float] = {}
    if count and len(steady) > 1:
        span = len(steady) - 1
        ops = {op: n / span for op, n in (steady[-1][1] - steady[0][1]).items()}
    Path(report).write_text(json.dumps({"per_update": per_update[WARMUP_UPDATES:],
                                        "seconds": seconds[WARMUP_UPDATES:], "by_op": ops}))


def activate_plugin_if_named(fairseq_args: list[str]) -> None:
    """In a child that imported the plugin itself, as fairseq would have for ``--user-dir``
    (fairseq skips a user dir whose package is imported already)."""
    if "--user-dir" in fairseq_args:
        import fairseq_shard_plugin

        fairseq_shard_plugin.activate()


def train_marking_updates(fairseq_args: list[str], mark: Callable[[], None],
                          around: contextlib.AbstractContextManager[Any]) -> None:
    """In a child: fairseq-train's ``cli_main`` on ``fairseq_args`` inside ``around``,
    ``mark()`` called as each update's ``Trainer.train_step`` starts."""
    import fairseq.trainer
    from fairseq_cli import train

    stock_step = fairseq.trainer.Trainer.train_step

    def marked_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        mark()
        return stock_step(self, *args, **kwargs)

    fairseq.trainer.Trainer.train_step = marked_step
    sys.argv = ["fairseq-train", *fairseq_args]
    with around:
        train.cli_main()


def run_child(module: str, corpus: Path, work: Path, name: str, updates: int,
              child_flags: list[str], label: str, threads: int = 1) -> Any:
    """Configuration ``name`` trained in a fresh process (one rank, torchrun's variables)
    under ``module``'s ``--child`` (with ``child_flags``); the JSON report it wrote."""
    save_dir = work / f"{name.replace(' ', '_').replace(',', '')}_{label}"
    report = save_dir.with_suffix(".json")
    args = [*training_args(corpus, save_dir, updates, max_tokens=512), *MODEL, "--no-save",
            "--disable-validation", *CONFIGS[name]]
    command = [sys.executable, "-m", module, "--child", str(report), *child_flags, "--",
               *args]
    code, output = start_ranks(command, 1, rank_environment(threads), timeout=600)
    if code != 0:
        raise RuntimeError(f"{name} failed ({code}):\n{output[-4000:]}")
    return json.loads(report.read_text())


def measure(corpus: Path, work: Path, name: str, updates: int, count: bool,
            threads: int = 1, meter: bool = False) -> dict[str, Any]:
    """One run of configuration ``name`` in a fresh process: the child's report."""
    kind = "count" if count else "meter" if meter else "time"
    flags = ["--count" if count else "--no-count", *(["--meter"] if meter else [])]
    return run_child("benchmarks.dispatch_ops", corpus, work, name, updates, flags, kind,
                     threads)


def compare(corpus: Path, work: Path, updates: int = 8,
            names: tuple[str, ...] = TABLE, time_them: bool = True) -> dict[str, Any]:
    """Operations (and, with ``time_them``, host seconds) per update of each configuration."""
    jobs = {name: (lambda name=name: measure(corpus, work, name, updates, count=True))
            for name in names}
    counted = in_threads(jobs)
    rows: dict[str, Any] = {}
    stock_ops = None
    for name in names:
        found = result_of(counted, name)
        ops = statistics.median(found["per_update"])
        stock_ops = stock_ops or ops
        rows[name] = {"ops_per_update": ops, "vs_stock": ops / stock_ops, "by_op": found["by_op"]}
    if time_them:
        for name in names:  # one at a time: host time is what is measured
            found = measure(corpus, work, name, updates, count=False)
            rows[name]["host_ms_per_update"] = 1000 * statistics.median(found["seconds"])
    return rows


def largest_differences(rows: dict[str, Any], name: str, top: int = 15
                        ) -> list[tuple[str, float, float]]:
    """The operations whose count per update differs most between ``name`` and stock."""
    stock, ours = rows["stock legacy_ddp"]["by_op"], rows[name]["by_op"]
    differences = [(op, ours.get(op, 0.0), stock.get(op, 0.0)) for op in set(stock) | set(ours)]
    return sorted(differences, key=lambda d: -abs(d[1] - d[2]))[:top]


def markdown(rows: dict[str, Any], command: str) -> str:
    lines = ["| configuration | aten operations per update | vs stock | host ms per update |",
             "|---|---|---|---|"]
    for name, row in rows.items():
        host = row.get("host_ms_per_update")
        lines.append(f"| {name} | {row['ops_per_update']:.0f} | {row['vs_stock']:.2f}x | "
                     f"{'' if host is None else f'{host:.1f}'} |")
    lines += ["", "World size 1, fp32 (unless named), 12+12 layers at width 32, 512 tokens per "
              f"update; medians over the updates after {WARMUP_UPDATES} of warm-up. Produced by "
              f"`{command}`.", ""]
    for name in rows:
        if name == "stock legacy_ddp":
            continue
        lines += [f"Largest differences, {name} against stock (operations per update):", "",
                  "| operation | plugin | stock |", "|---|---|---|"]
        lines += [f"| `{op}` | {ours:.1f} | {stock:.1f} |"
                  for op, ours, stock in largest_differences(rows, name)]
        lines.append("")
    return "\n".join(lines)


def meter_cost(make_corpus: Any, updates: int) -> None:
    """Host ms per update of stock and the plugin, without and with the live-tensor meter
    (a dispatch mode) that the first GPU check ran every training under."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = make_corpus(Path(tmp) / "corpus")
        for name in ("stock legacy_ddp", "plugin fsdp2"):
            ms = [1000 * statistics.median(measure(corpus, Path(tmp), name, updates, count=False,
                                                   meter=meter)["seconds"])
                  for meter in (False, True)]
            rows.append({"configuration": name, "host_ms_per_update": round(ms[0], 1),
                         "with_meter_ms": round(ms[1], 1), "added_ms": round(ms[1] - ms[0], 1)})
    lines = ["| configuration | host ms per update | under the tensor meter | added |",
             "|---|---|---|---|"]
    lines += [f"| {r['configuration']} | {r['host_ms_per_update']} | {r['with_meter_ms']} | "
              f"+{r['added_ms']} |" for r in rows]
    lines += ["", "World size 1, fp32, 12+12 layers at width 32, 512 tokens per update; medians "
              f"after {WARMUP_UPDATES} updates of warm-up. Produced by "
              f"`python -m benchmarks.dispatch_ops --meter --updates {updates}`.", ""]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "meter_cost.json").write_text(json.dumps(rows, indent=1) + "\n")
    (RESULTS / "meter_cost.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--count", action=argparse.BooleanOptionalAction, default=True,
                        help=argparse.SUPPRESS)
    parser.add_argument("--updates", type=int, default=12)
    parser.add_argument("--name", default="dispatch_ops")
    parser.add_argument("--meter", action="store_true",
                        help="host time per update with and without fairseq-shard-measure-"
                        "train's live-tensor meter instead (results/meter_cost.*)")
    args, rest = parser.parse_known_args()
    if args.child:
        child(args.child, rest[1:] if rest[:1] == ["--"] else rest, args.count, args.meter)
        return
    from fairseq_shard_plugin.cli.synthetic_data import make_corpus

    if args.meter:
        meter_cost(make_corpus, args.updates)
        return
    with tempfile.TemporaryDirectory() as tmp:
        corpus = make_corpus(Path(tmp) / "corpus")
        rows = compare(corpus, Path(tmp), updates=args.updates)
    command = f"python -m benchmarks.dispatch_ops --updates {args.updates}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    (RESULTS / f"{args.name}.md").write_text(markdown(rows, command))
    print(markdown(rows, command))


if __name__ == "__main__":
    main()
