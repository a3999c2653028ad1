"""Throughput and tokens per step under a memory budget: the plugin against stock DDP.

Same corpus, model, seed and ranks for every configuration:

1. **Throughput at the same batch** (``--max-tokens``): words per second and seconds per
   update from fairseq's own per-update log (``wps``; step time = words per batch / wps),
   medians over the updates after a warm-up, then the median over ``--rounds`` rounds that
   interleave the configurations (other load on the machine hits all of them alike). No
   memory meter runs here (``--no-memory-report`` for the plugin).
2. **Tokens per step under a memory budget**: for each configuration the largest
   ``--max-tokens`` whose measured peak tensor memory per rank stays within ``--budget-mib``:
   every probe trains a few updates under ``fairseq-shard-measure-train`` (live CPU tensor
   bytes, or CUDA's peak allocated bytes), the same meter for stock fairseq and the plugin;
   the search brackets the budget and interpolates (peak memory grows about linearly with
   tokens), down to ``--granule`` tokens.

Stock DDP is fairseq's ``legacy_ddp`` (stock ``c10d`` cannot wrap CPU modules). Hybrid
sharding on 2 ranks is 2 shard groups of 1 rank (``--shard-group-size 1``): the replicate
path across "nodes"; its row is left out when the plugin has no ``--shard-strategy``.

    python -m benchmarks.throughput                  # 2 CPU ranks; writes results/throughput.*
    python -m benchmarks.throughput --cuda --nproc 1 # on a GPU machine
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from fairseq_shard_plugin.cli.synthetic_data import make_corpus
from fairseq_shard_plugin.sharding.options import ShardingConfig
from launching.harness import (
    REPO,
    RunResult,
    run_training,
    training_args,
    transformer_args,
    write_results,
)

MIB = 1024**2
WARMUP_UPDATES = 3  # the first updates build the iterator, FSDP's lazy state, Adam's state
CHUNKED_LOSS = "chunked_label_smoothed_cross_entropy"


@dataclass(frozen=True)
class Config:
    name: str
    plugin: bool
    flags: list[str] = field(default_factory=list)
    note: str = ""
    criterion: str | None = None  # replaces label_smoothed_cross_entropy


def configs(cuda: bool) -> dict[str, Config]:
    """Every configuration this plugin version can run."""
    found = {
        "ddp": Config("ddp", False, note="stock fairseq, --ddp-backend legacy_ddp"),
        "sharded": Config("sharded", True, note="plugin, --ddp-backend fully_sharded"),
        "sharded+root": Config(
            "sharded+root", True, ["--keep-root-gathered"],
            "plugin, --keep-root-gathered (root unit kept gathered from forward to backward)"),
        "sharded+vocab": Config(
            "sharded+vocab", True, ["--keep-vocabulary-gathered"],
            "plugin, --keep-vocabulary-gathered (one all-gather of the vocabulary unit per "
            "step)"),
        "sharded+memory": Config(
            "sharded+memory", True, ["--checkpoint-activations"],
            f"plugin + chunked loss (--criterion {CHUNKED_LOSS}) + --checkpoint-activations",
            criterion=CHUNKED_LOSS),
    }
    if "shard_strategy" in {option.name for option in fields(ShardingConfig)}:
        found["hybrid"] = Config(
            "hybrid", True, ["--shard-strategy", "hybrid", "--shard-group-size", "1"],
            "plugin, --shard-strategy hybrid --shard-group-size 1 (2 groups of 1 rank)")
    return found


@dataclass
class Setup:
    data: Path
    work: Path
    model: list[str]
    nproc: int
    cuda: bool


def command_args(setup: Setup, config: Config, max_tokens: int, updates: int, tag: str
                 ) -> list[str]:
    args = training_args(setup.data, setup.work / tag / "save", updates, max_tokens=max_tokens,
                         cpu=not setup.cuda)
    args += setup.model + ["--no-save", "--disable-validation", "--no-progress-bar"]
    if config.criterion:
        args[args.index("--criterion") + 1] = config.criterion
    if config.plugin:
        args += ["--task", "sharded_translation"]
    return args + config.flags


def train(setup: Setup, config: Config, args: list[str], measure: Path | None) -> RunResult:
    return run_training(args, nproc=setup.nproc, plugin=config.plugin, measure_dir=measure,
                        timeout=1800, cuda=setup.cuda)


# --- 1. throughput at the same batch -------------------------------------------------------

def throughput(run: RunResult) -> tuple[float, float, float]:
    """Median words/s, median seconds/update and the upper quartile of words/s over the
    updates after the warm-up (the quartile is the least disturbed by other load)."""
    entries = run.logs["train_inner"][WARMUP_UPDATES:]
    if len(entries) < 2:
        raise RuntimeError("fewer than 2 updates after the warm-up: raise --updates")
    wps = [float(entry["wps"]) for entry in entries]
    step = [float(entry["wpb"]) / float(entry["wps"]) for entry in entries]
    return statistics.median(wps), statistics.median(step), statistics.quantiles(wps, n=4)[2]


def measure_throughput(setup: Setup, names: list[str], max_tokens: int, updates: int,
                       rounds: int) -> dict[str, dict]:
    """Each configuration ``rounds`` times, interleaved (order rotated every round)."""
    found = configs(setup.cuda)
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}
    losses: dict[str, float] = {}
    loads: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        order = names[round_index % len(names):] + names[: round_index % len(names)]
        for name in order:
            config = found[name]
            args = command_args(setup, config, max_tokens, updates, f"tp-{name}")
            if config.plugin:
                args += ["--no-memory-report"]
            started = time.time()
            run = train(setup, config, args, None)
            loads[name].append(os.getloadavg()[0])
            samples[name].append(throughput(run))
            losses[name] = run.series("train_inner", "loss")[-1]
            print(f"  throughput {name} round {round_index + 1}: {samples[name][-1][0]:.0f} "
                  f"words/s ({time.time() - started:.0f} s)", flush=True)
    return {
        name: {
            "words_per_s": statistics.median(w for w, _, _ in samples[name]),
            "s_per_update": statistics.median(s for _, s, _ in samples[name]),
            "words_per_s_q3": statistics.median(q for _, _, q in samples[name]),
            "words_per_s_rounds": [round(w, 1) for w, _, _ in samples[name]],
            "last_loss": losses[name],
            "load_average_1min": round(max(loads[name]), 2),
        }
        for name in names
    }


# --- 2. tokens per step under a memory budget ----------------------------------------------

def peak_mib(setup: Setup, config: Config, max_tokens: int, updates: int) -> float:
    """Peak tensor memory per rank (max over ranks) of a short training at ``max_tokens``."""
    tag = f"mem-{config.name}-{max_tokens}"
    run = train(setup, config, command_args(setup, config, max_tokens, updates, tag),
                setup.work / tag / "memory")
    key = "cuda_peak_allocated_bytes" if setup.cuda else "peak_bytes"
    return max(rank[key] for rank in run.memory) / MIB


def largest_batch(setup: Setup, config: Config, budget_mib: float, start: int, granule: int,
                  cap: int, updates: int, max_probes: int) -> dict:
    """Largest --max-tokens (a multiple of ``granule``) whose peak fits ``budget_mib``."""
    probes: dict[int, float] = {}

    def probe(tokens: int) -> float:
        probes[tokens] = peak_mib(setup, config, tokens, updates)
        print(f"  budget {config.name}: {tokens} tokens -> {probes[tokens]:.1f} MiB", flush=True)
        return probes[tokens]

    probe(start)
    while len(probes) < max_probes:
        fits = [t for t, mib in probes.items() if mib <= budget_mib]
        over = [t for t, mib in probes.items() if mib > budget_mib]
        low, high = (max(fits) if fits else None), (min(over) if over else None)
        if low is None:  # even the smallest probe is over: try a smaller batch
            guess = min(probes) // 2
            if guess < granule:
                break
        elif high is not None and high - low <= granule:
            break
        elif low >= cap:
            break
        else:
            guess = _next_guess(probes, low, high, budget_mib, granule, cap)
        if guess in probes:
            break
        probe(guess)
    fits = [t for t, mib in probes.items() if mib <= budget_mib]
    best = max(fits) if fits else None
    return {
        "tokens_per_rank": best,
        "peak_mib": round(probes[best], 1) if best else None,
        "at_cap": best is not None and best >= cap,
        "probes": {str(t): round(mib, 1) for t, mib in sorted(probes.items())},
    }


def _next_guess(probes: dict[int, float], low: int, high: int | None, budget: float,
                granule: int, cap: int) -> int:
    """Interpolate between the bracket's ends (or extrapolate from the two largest probes
    that fit), rounded to the granule and kept strictly inside the bracket."""
    if high is not None:
        a, b = low, high
    else:
        below = sorted(t for t, mib in probes.items() if mib <= budget)
        a, b = (below[-2], below[-1]) if len(below) > 1 else (None, low)
    if a is None or probes[b] == probes[a]:
        guess = 2 * low
    else:
        slope = (probes[b] - probes[a]) / (b - a)
        guess = int(a + (budget - probes[a]) / slope) if slope > 0 else 2 * low
        if high is None:
            guess = min(guess, 4 * low)  # do not trust a long extrapolation
    guess = guess // granule * granule
    upper = min(high - granule, cap) if high is not None else cap
    return max(low + granule, min(guess, upper))


# --- report ---------------------------------------------------------------------------------

def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=4000, help="word types per language")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--cuda", action="store_true", help="train on GPUs (NCCL)")
    parser.add_argument("--max-tokens", type=int, default=1024, help="batch of the throughput runs")
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget-mib", type=float, default=256.0)
    parser.add_argument("--granule", type=int, default=64)
    parser.add_argument("--cap", type=int, default=16384, help="largest batch searched")
    parser.add_argument("--probe-updates", type=int, default=2)
    parser.add_argument("--max-probes", type=int, default=6)
    parser.add_argument("--skip", nargs="*", default=[], help="configurations left out")
    parser.add_argument("--name", default="throughput", help="results file name")
    return parser


def main() -> None:
    parser = make_parser()
    options = parser.parse_args()

    work = REPO / "demo_work" / "throughput"
    data = work / "corpus" / "bin"
    if not data.exists():
        make_corpus(work / "corpus", vocab=options.vocab, train=20000, max_len=30)
    setup = Setup(data, work, transformer_args(options.dim, options.ffn, options.layers),
                  options.nproc, options.cuda)
    found = configs(options.cuda)
    names = [name for name in found if name not in options.skip]
    speed = measure_throughput(setup, names, options.max_tokens, options.updates,
                               options.rounds)
    budget = {name: largest_batch(setup, found[name], options.budget_mib,
                                  start=options.max_tokens // 2, granule=options.granule,
                                  cap=options.cap, updates=options.probe_updates,
                                  max_probes=options.max_probes)
              for name in names}
    rows = report_rows(names, found, speed, budget)
    device = f"{options.nproc} {'CUDA' if options.cuda else 'CPU'} ranks"
    note = (
        f"Model d {options.dim}, ffn {options.ffn}, {options.layers}+{options.layers} layers, "
        f"shared embeddings, vocabulary {options.vocab} per language; {device}; fp32 Adam. "
        f"Throughput at --max-tokens {options.max_tokens} per rank, median over updates "
        f"{WARMUP_UPDATES + 1}-{options.updates} and over {options.rounds} interleaved rounds. "
        f"Budget: largest --max-tokens (multiple of {options.granule}, searched up to "
        f"{options.cap}) whose peak tensor memory per rank <= {options.budget_mib:g} MiB.\n\n"
        f"Produced by `.venv/bin/python -m benchmarks.throughput{cli_suffix(parser, options)}`."
    )
    print(write_results(options.name, rows, COLUMNS, note))


COLUMNS = [
    ("run", "run"), ("what runs", "note"), ("words/s", "words_per_s"),
    ("words/s per round", "rounds_text"), ("s/update", "s_per_update"),
    ("x DDP words/s", "speed_vs_ddp"),
    ("tokens/step/rank at budget", "budget_tokens"), ("peak MiB there", "budget_peak_mib"),
    ("x DDP tokens", "tokens_vs_ddp"),
]


def report_rows(names: list[str], found: dict[str, Config], speed: dict[str, dict],
                budget: dict[str, dict]) -> list[dict]:
    ddp_speed = speed.get("ddp", {}).get("words_per_s")
    ddp_q3 = speed.get("ddp", {}).get("words_per_s_q3")
    ddp_tokens = budget.get("ddp", {}).get("tokens_per_rank")
    rows = []
    for name in names:
        tokens = budget[name]["tokens_per_rank"]
        rows.append({
            "run": name, "note": found[name].note,
            "words_per_s": round(speed[name]["words_per_s"], 1),
            "s_per_update": round(speed[name]["s_per_update"], 3),
            "speed_vs_ddp": round(speed[name]["words_per_s"] / ddp_speed, 2)
            if ddp_speed else None,
            "q3_vs_ddp": round(speed[name]["words_per_s_q3"] / ddp_q3, 2) if ddp_q3 else None,
            "rounds_text": ", ".join(f"{w:.0f}" for w in speed[name]["words_per_s_rounds"]),
            "budget_tokens": None if tokens is None
            else f"{'>=' if budget[name]['at_cap'] else ''}{tokens}",
            "budget_peak_mib": budget[name]["peak_mib"],
            "tokens_vs_ddp": round(tokens / ddp_tokens, 2) if tokens and ddp_tokens else None,
            "words_per_s_rounds": speed[name]["words_per_s_rounds"],
            "words_per_s_q3": round(speed[name]["words_per_s_q3"], 1),
            "max_load_average_1min": speed[name]["load_average_1min"],
            "last_loss": speed[name]["last_loss"],
            "budget_probes": budget[name]["probes"],
        })
    return rows


def cli_suffix(parser: argparse.ArgumentParser, options: argparse.Namespace) -> str:
    """The options that differ from their defaults, as command-line flags."""
    parts = []
    for key, value in vars(options).items():
        if value == parser.get_default(key):
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, list):
            parts.append(" ".join([flag, *value]))
        else:
            parts.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    return "".join(" " + part for part in parts)


if __name__ == "__main__":
    main()
