"""The wrap policy on fairseq models without transformer layers: per-block units or one unit.

For fairseq's own ``fconv_wmt_en_de``, ``lightconv_wmt_en_de`` and ``lstm_luong_wmt_en_de``
(their registered sizes) on fairseq's dummy translation data (tests/fairseq_fixtures.py:
``create_dummy_data(num_examples=200, maxlen=20)``, joined dictionary), train 4 updates on
2 CPU ranks with the plugin, twice:

- ``default``: the plugin's plan (``wrap_policy.build_plan``): every block of a repeated
  stack (fconv convolutions and decoder attention layers, lightconv layers) and every
  recurrent network (LSTM encoder) is a unit, the vocabulary modules another, the root
  holds the rest;
- ``root-only``: ``--root-unit-only``, one unit holding the whole model (stock fairseq's
  plan when every layer is below ``--min-params-to-wrap``).

Both run under ``--task sharded_translation`` (the plugin's task, which owns
``--root-unit-only``) so that the two differ only in the plan. Per run: the plan line the
trainer logs, the largest ``peak_mem_gb`` (peak live tensor bytes of a step, max over ranks)
over updates 2-4, ``state_mem_gb``, the mean wall-clock seconds per update over updates 2-4
(time between consecutive ``train_inner`` lines of rank 0 as they appear, polled every
50 ms: fairseq rounds its own ``train_wall`` to whole seconds; the median over ``--rounds``
interleaved repeats, as it varies from run to run on a shared machine), and whether the
per-update losses of the two plans agree (the same math: they should, to the 3 decimals
fairseq logs).

    python -m benchmarks.architectures   # writes benchmarks/results/architectures.{md,json}
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from launching.harness import LOG_LINE, REPO, RunResult, run_training, write_results

ARCHS = ("fconv_wmt_en_de", "lightconv_wmt_en_de", "lstm_luong_wmt_en_de")
# arch size overrides, only where a run at the registered size would not fit this machine
# (none needed so far: every arch runs at its registered size)
OVERRIDES: dict[str, list[str]] = {}
PLANS = {"default": [], "root-only": ["--root-unit-only"]}
TRAIN = ["--cpu", "--optimizer", "adam", "--lr", "1e-4", "--max-tokens", "500",
         "--max-update", "4", "--log-format", "json", "--log-interval", "1",
         "--num-workers", "0", "--disable-validation", "--no-save", "--seed", "1"]
LANGS = ["--source-lang", "in", "--target-lang", "out"]
PLAN_LINE = re.compile(r"sharded over \d ranks with fsdp2: (.*?); compute in")
PARAMETERS = re.compile(r"of ([\d,]+) parameters")
ROOT_SHARE = re.compile(r"the root unit holds (\d+%)")
MEASURED_UPDATES = (2, 3, 4)  # update 1 builds FSDP's lazy state and Adam's state
MIB_PER_GIB = 1024


def fixtures():
    """tests/fairseq_fixtures.py (fairseq's own test-data fixtures; tests/ is no package)."""
    spec = importlib.util.spec_from_file_location(
        "fairseq_fixtures", REPO / "tests" / "fairseq_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_data(directory: Path) -> Path:
    """fairseq's dummy translation data, binarised with a joined dictionary (seeded)."""
    random.seed(1)
    torch.manual_seed(1)
    module = fixtures()
    module.create_dummy_data(str(directory), num_examples=200, maxlen=20)
    module.preprocess_translation_data(str(directory), ["--joined-dictionary"])
    return directory


class UpdateClock:
    """A ``run_training`` watcher: when each ``train_inner`` line first appears (rank 0)."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}

    def __call__(self, ranks: list[subprocess.Popen], outputs: list[str]) -> None:
        now = time.monotonic()
        for line in outputs[0].splitlines():
            match = LOG_LINE.search(line)
            if match and match.group(1) == "train_inner":
                update = int(re.search(r'"num_updates": "?(\d+)', match.group(2)).group(1))
                self.seen.setdefault(update, now)

    def seconds_per_update(self, updates: tuple[int, ...]) -> float | None:
        deltas = [self.seen[u] - self.seen[u - 1] for u in updates
                  if u in self.seen and u - 1 in self.seen]
        return statistics.mean(deltas) if deltas else None


def train(arch: str, plan: str, data: Path) -> tuple[RunResult, UpdateClock, float]:
    args = [str(data), "--task", "sharded_translation", "--arch", arch,
            *OVERRIDES.get(arch, []), *LANGS, *TRAIN, *PLANS[plan]]
    clock = UpdateClock()
    started = time.monotonic()
    run = run_training(args, nproc=2, plugin=True, timeout=600, watch=clock)
    return run, clock, time.monotonic() - started


def per_update(run: RunResult, key: str) -> dict[int, float]:
    return {int(e["num_updates"]): float(e[key]) for e in run.logs["train_inner"] if key in e}


def measure(arch: str, plan: str, data: Path) -> dict:
    run, clock, total = train(arch, plan, data)
    plans = PLAN_LINE.findall(run.output)
    peaks = per_update(run, "peak_mem_gb")
    states = per_update(run, "state_mem_gb")
    walls = per_update(run, "train_wall")
    updates = sorted(per_update(run, "loss"))
    assert updates == [1, 2, 3, 4], (arch, plan, updates)
    peak = max(peaks[u] for u in MEASURED_UPDATES)
    seconds = clock.seconds_per_update(MEASURED_UPDATES)
    return {
        "arch": arch,
        "plan": plan,
        "units": plans[0] if plans else None,
        "parameters": int(PARAMETERS.search(plans[0]).group(1).replace(",", ""))
        if plans else None,
        "peak_mib": round(peak * MIB_PER_GIB, 1),
        "state_mib": round(states[max(states)] * MIB_PER_GIB, 1),
        "seconds_per_update": None if seconds is None else round(seconds, 2),
        "train_wall_per_update": round(statistics.mean(walls[u] for u in MEASURED_UPDATES), 2)
        if all(u in walls for u in MEASURED_UPDATES) else None,
        "run_seconds": round(total, 1),
        "losses": [per_update(run, "loss")[u] for u in updates],
    }


def merge(rounds: list[dict]) -> dict:
    """One arch and plan over the rounds: the first round's row, the median seconds per
    update, each round's seconds and losses."""
    row = dict(rounds[0])
    seconds = [r["seconds_per_update"] for r in rounds if r["seconds_per_update"] is not None]
    row["seconds_per_update"] = round(statistics.median(seconds), 2) if seconds else None
    row["seconds_per_update_rounds"] = [r["seconds_per_update"] for r in rounds]
    row["train_wall_per_update"] = [r["train_wall_per_update"] for r in rounds]
    row["run_seconds"] = [r["run_seconds"] for r in rounds]
    row["peak_mib"] = max(r["peak_mib"] for r in rounds)  # the same in every round
    row["losses_rounds"] = [r["losses"] for r in rounds]
    return row


def compare(default: dict, root_only: dict) -> None:
    """Fill both rows' comparison of the default plan with root-only (same arch): losses of
    every round of both plans against the default plan's first round, per-round ratios of
    seconds per update."""
    reference = default["losses"]
    relative = max(abs(a - b) / max(abs(a), 1e-12)
                   for losses in default["losses_rounds"] + root_only["losses_rounds"]
                   for a, b in zip(reference, losses, strict=True))
    ratios = [a / b for a, b in zip(default["seconds_per_update_rounds"],
                                    root_only["seconds_per_update_rounds"], strict=True)
              if a and b]
    for row in (default, root_only):
        row["max_loss_rel_diff"] = relative
        row["losses_agree"] = relative <= 1e-4  # 3 logged decimals of a loss of ~5
        row["root_only_peak_mib"] = root_only["peak_mib"]
        row["peak_vs_root_only"] = round(row["peak_mib"] / root_only["peak_mib"], 3)
    default["time_vs_root_only"] = round(statistics.median(ratios), 2) if ratios else None
    default["time_ratio_range"] = (f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else None)
    root_only["time_vs_root_only"], root_only["time_ratio_range"] = 1.0, "1.00"


COLUMNS = [
    ("arch", "arch"), ("parameters", "parameters"), ("plan", "plan"),
    ("plan line (trainer log)", "units"), ("peak MiB (max over updates 2-4)", "peak_mib"),
    ("peak vs root-only", "peak_vs_root_only"), ("model state MiB / rank", "state_mib"),
    ("s / update (wall, updates 2-4; median over rounds)", "seconds_per_update"),
    ("time vs root-only (median of rounds)", "time_vs_root_only"),
    ("time ratio range", "time_ratio_range"), ("losses (updates 1-4)", "losses"),
    ("losses agree", "losses_agree"),
]


def reading(rows: list[dict], rounds: int) -> str:
    """Two sentences on the result, from the rows."""
    default = [row for row in rows if row["plan"] == "default"]
    peaks = ", ".join(
        f"{row['arch']} {row['peak_mib']:.0f} vs {row['root_only_peak_mib']:.0f} MiB "
        f"({100 * (row['peak_vs_root_only'] - 1):+.0f}%; the root unit holds "
        f"{ROOT_SHARE.search(row['units'] or '').group(1)} of the parameters)"
        for row in default)
    times = ", ".join(
        f"{row['arch']} x{row['time_vs_root_only']:.2f} ({row['time_ratio_range']})"
        for row in default
        if row["time_vs_root_only"] is not None)
    agree = all(row["losses_agree"] for row in rows)
    return (f"Peak tensor memory per rank, default plan vs --root-unit-only: {peaks}. "
            f"Seconds per update, default over root-only (median of {rounds} interleaved "
            f"rounds, range in brackets, on a machine shared with other work): {times}; the "
            "per-update losses of "
            f"the two plans {'agree' if agree else 'DO NOT agree'} (max relative difference "
            f"{max(row['max_loss_rel_diff'] for row in rows):.1e} at the 3 decimals fairseq "
            "logs).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--name", default="architectures",
                        help="results file name under benchmarks/results/")
    parser.add_argument("--rounds", type=int, default=2,
                        help="interleaved repeats of every run (seconds per update vary "
                        "from run to run on a shared machine; memory and losses do not)")
    options = parser.parse_args()
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="architectures_") as tmp:
        data = make_data(Path(tmp))
        for round_ in range(options.rounds):  # interleaved; plan order alternates
            for arch in options.archs:
                for plan in list(PLANS)[:: 1 if round_ % 2 == 0 else -1]:
                    row = measure(arch, plan, data)
                    runs.setdefault((arch, plan), []).append(row)
                    print(round_, row, flush=True)
    rows = []
    for arch in options.archs:
        merged = {plan: merge(runs[arch, plan]) for plan in PLANS}
        compare(merged["default"], merged["root-only"])
        rows += merged.values()
    overrides = "; ".join(f"{arch}: {' '.join(flags)}" for arch, flags in OVERRIDES.items())
    note = (
        "Produced by `.venv/bin/python -m benchmarks.architectures` (2 CPU gloo ranks, "
        "fairseq's dummy translation data: create_dummy_data(num_examples=200, maxlen=20), "
        "--joined-dictionary; --task sharded_translation for both plans; "
        f"{' '.join(TRAIN)}). Archs at their registered sizes"
        + (f", except: {overrides}" if overrides else "") + ". "
        "Peak: the plugin's `peak_mem_gb` (peak live tensor bytes of a step, max over ranks); "
        "model state: `state_mem_gb` (parameters, gradients and Adam state of a rank); "
        "s / update: mean wall-clock time between consecutive `train_inner` log lines of "
        "rank 0 for updates 2-4 (fairseq's own `train_wall` is rounded to whole seconds; "
        "it is in the JSON as `train_wall_per_update`), median over "
        f"{options.rounds} interleaved rounds (each round's in the JSON). Losses as logged "
        "(3 decimals), every round of both plans compared.\n\n" + reading(rows, options.rounds)
    )
    print(write_results(options.name, rows, COLUMNS, note))


if __name__ == "__main__":
    main()
