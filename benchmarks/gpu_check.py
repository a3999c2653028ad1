"""GPU check on one CUDA device, at the NLLB-600M shape, in two parts (``gpu_check.sh``
runs both, each under its own time budget).

Part 1, ``trainings``: speed in steady state. Stock fairseq's own ``--ddp-backend
fully_sharded`` (fairscale) path as shipped, the plugin's default FSDP2 engine, the NLLB
configs (16-bit state and memory features), the fairscale engine, each memory feature
toggled alone on the default (activation checkpointing, chunked loss, 16-bit parameters,
16-bit Adam moments, gathered vocabulary), the default at 16,384 tokens, and stock fairseq
without sharding (``legacy_ddp``: what any engine at world size 1 could reach) (``RUNS``, in
order of importance: the budget may end the list early); same model, data and seed, 40
updates each. The model is ``nllb_dense_600m``'s shape spelled out in fairseq's own flags
(12+12 layers, d 1024, ffn 4096, 16 heads, shared embeddings, pre-norm), so that stock
fairseq, which does not know the plugin's architecture names, trains the same thing; the
joined dictionary is padded to the NLLB vocabulary of 256,206 entries.

Speed is words/s and ms per update over updates 11-40 (``steady_state``: the start times
of the optimizer steps, which the launcher records after the device has finished its queued
work, and fairseq's per-update ``wpb``), not an epoch summary that includes start-up; MFU is
``model_flops_per_update`` per second against the device's dense fp16 peak. A profile of
updates 32-34 (``fairseq_shard_plugin.cli.update_timing``) gives the device's busy time
against the wall time per update, kernel launches per update and the top kernels. No CPU
tensor meter runs in these processes: the first GPU run (2026-12-04) measured every row
under ``LiveTensorMeter``, a dispatch mode that puts every aten operation through Python;
on CPU it added 245 ms per update to stock and 252 ms to the plugin on a small model
(``python -m benchmarks.dispatch_ops --meter``, ``results/meter_cost.md``), so those
words/s include that cost in every row.

Every run is launched by ``launching.harness.run_training`` through
``fairseq-shard-measure-train`` (it calls ``fairseq_cli.train.cli_main``). The stock row's
command has no ``--user-dir``, and the launcher activates the plugin only when
``--user-dir`` names it (importing the package installs nothing), so that process runs
stock fairseq: no plugin task, architecture or hook; it gets stock fairseq's own
distributed flags for one rank (``STOCK_DISTRIBUTED``: fairscale needs a process group, which
fairseq does not create at world size 1). Each row records its launcher and how
many log lines came from the plugin's loggers (0 for stock, checked). CUDA's peaks are
whole-run peaks: stock fairseq resets CUDA's peak statistics every update (and the plugin's
step probe does too), and the launcher folds each step's peak into a running maximum
before every reset. Next to them: the peak the plugin predicted before its first step and
the final loss. One device means world size 1: these runs compare the code paths and the
memory features.

Part 2, ``memory``: the 600M memory table of ``benchmarks.memory`` measured with CUDA
statistics, per rank at world size 2, on a fake process group in one process per
configuration. On CUDA, fairseq's Trainer checks that gradient norms agree across ranks
(``_check_grad_norms``, an all-reduce into a buffer it creates only on CUDA with more than
one data-parallel rank); the fake group's all-reduce leaves the other rank's slot at zero,
so that check would fail every step. It is not reached on CPU (no buffer), and fairseq has
no flag for it (it skips it only for BMUF, slowmo and TPUs, none of which apply), so each
configuration's trainer here drops the buffer, as fairseq's CPU path has it
(``memory-one``); nothing else differs from ``python -m benchmarks.memory --cuda``.

Both parts write their results after every run, so a timeout keeps what finished; each
stops starting runs when its ``--budget`` (seconds) is spent and exits 0.

    python -m benchmarks.gpu_check [trainings] [--budget S]  # results/gpu_check.{md,json}
    python -m benchmarks.gpu_check memory [--budget S]       # results/gpu_memory_600m.*
    python -m benchmarks.gpu_check {trainings,memory} --dry-run   # on CPU, tiny model,
        # results in a temporary directory: checks the launchers and the result writing
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from launching import harness
from launching.harness import REPO, run_training, training_args, transformer_args, write_results

GIB = 1024**3
NLLB_VOCABULARY = 256_206  # fairseq's 4 special symbols included
MODEL = transformer_args(dim=1024, ffn=4096, layers=12, heads=16)
RUN_TIMEOUT = 90  # seconds at most per training run (twice for 16,384 tokens; fewer when
# the part's budget is short)
MINIMUM_RUN = 20  # a run is not started with less time than this left
# Stock fairseq at world size 1 runs its "single GPU main" without a process group, where
# fairscale's FSDP (0.4.13: its reduce-scatter group) fails; these stock flags make it
# initialise one (one rank, env:// from the variables run_training sets, as torchrun would).
STOCK_DISTRIBUTED = ["--distributed-world-size", "1", "--distributed-rank", "0",
                     "--distributed-init-method", "env://", "--distributed-no-spawn",
                     "--device-id", "0"]
CHUNKED_LOSS = ["--criterion", "chunked_label_smoothed_cross_entropy",
                "--loss-chunk-tokens", "1024"]
# the NLLB configs' memory features (configs/nllb), beside their 16-bit state
NLLB_FEATURES = [*CHUNKED_LOSS, "--checkpoint-activations", "--reduce-vocabulary-in-16-bit",
                 "--keep-vocabulary-gathered"]
PLUGIN_TASK = ["--task", "sharded_translation"]


@dataclass(frozen=True)
class Run:
    name: str
    plugin: bool
    flags: list[str]
    tokens: int = 4096
    environment: tuple[tuple[str, str], ...] = ()  # variables for the ranks
    stock_backend: str = "fully_sharded"  # stock rows' --ddp-backend


# in order of importance: the budget may end the list early
RUNS = [
    Run("stock fairseq fully_sharded (fairscale), fp16", False, ["--fp16", *STOCK_DISTRIBUTED]),
    Run("plugin fsdp2 (the default), fp16", True, ["--fp16", *PLUGIN_TASK]),
    # the default steps with torch's fused multi-tensor Adam on GPUs; fairseq's own Adam
    # launches about ten kernels per parameter tensor (FSDP2 keeps ~400 tensors)
    Run("plugin fsdp2, fp16, fairseq's own Adam (--use-old-adam)", True,
        ["--fp16", *PLUGIN_TASK, "--use-old-adam"]),
    # one unit gathered from forward to backward: FSDP2's hooks once per pass instead of
    # per layer, no copies in backward (CPU proxy: 23% less host time per update,
    # benchmarks/results/dispatch_ops.md); at world size 1 it costs the gathered fp16 copy
    Run("plugin fsdp2, fp16, one unit kept gathered (--root-unit-only "
        "--no-reshard-after-forward)", True,
        ["--fp16", *PLUGIN_TASK, "--root-unit-only", "--no-reshard-after-forward"]),
    # four consecutive layers per unit: a quarter of the layer units (their FSDP2 hooks and
    # collectives), for up to six more layers gathered (CPU proxy: benchmarks/results/
    # host_time_split.md); unlike the row above it keeps the layers resharded
    Run("plugin fsdp2, fp16, 4 layers per unit (--layers-per-unit 4)", True,
        ["--fp16", *PLUGIN_TASK, "--layers-per-unit", "4"]),
    Run("plugin fsdp2, the NLLB configs (16-bit state and memory features)", True,
        ["--memory-efficient-fp16", "--fp16-adam-stats", *PLUGIN_TASK, *NLLB_FEATURES]),
    # the MFU goal (at least 30%) is set at this batch
    Run("plugin fsdp2 (the default), fp16, 16,384 tokens", True, ["--fp16", *PLUGIN_TASK],
        tokens=16384),
    # the bound for any sharding engine at world size 1: stock fairseq with no wrapper at
    # all (fp16 parameters, fp32 master copy in FP16Optimizer, fairseq's per-tensor Adam)
    Run("stock fairseq without sharding (legacy_ddp), fp16", False, ["--fp16"],
        stock_backend="legacy_ddp"),
    # sharded CUDA runs get expandable segments from the plugin unless the variable is set
    Run("plugin fsdp2 (the default), fp16, without expandable segments", True,
        ["--fp16", *PLUGIN_TASK],
        environment=(("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False"),)),
    Run("plugin fairscale engine, fp16", True,
        ["--fp16", *PLUGIN_TASK, "--shard-engine", "fairscale"]),
    Run("plugin fsdp2, fp16 + activation checkpointing", True,
        ["--fp16", *PLUGIN_TASK, "--checkpoint-activations"]),
    Run("plugin fsdp2, fp16 + chunked loss (1024 tokens)", True,
        ["--fp16", *PLUGIN_TASK, *CHUNKED_LOSS]),
    Run("plugin fsdp2, 16-bit parameters (--memory-efficient-fp16)", True,
        ["--memory-efficient-fp16", *PLUGIN_TASK]),
    Run("plugin fsdp2, fp16 + 16-bit Adam moments (--fp16-adam-stats)", True,
        ["--fp16", "--fp16-adam-stats", *PLUGIN_TASK]),
    Run("plugin fsdp2, fp16 + gathered vocabulary (--keep-vocabulary-gathered)", True,
        ["--fp16", *PLUGIN_TASK, "--keep-vocabulary-gathered"]),
    # every unit stays gathered from its forward to its backward: no gathers in backward
    # (benchmarks/fsdp2_host_overhead.py: FSDP2's host time is mostly per unit and pass)
    Run("plugin fsdp2, fp16, --no-reshard-after-forward", True,
        ["--fp16", *PLUGIN_TASK, "--no-reshard-after-forward"]),
]
# steady state: the words and time of updates STEADY[0]..STEADY[1] (after a warm-up), and a
# profile of three of them
STEADY = (11, 40)
PROFILED = (32, 34)
# dense fp16/bf16 peak of the device, by name (the H200's and H100's tensor cores)
PEAK_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}
TRAINING_COLUMNS = [
    ("run", "run"), ("status", "status"),
    ("CUDA peak allocated / reserved (GiB)", "cuda_peak_gib"),
    ("predicted peak (GiB)", "predicted_peak_gib"), ("final loss", "final_loss"),
    ("steady words/s", "steady_words_per_second"), ("ms per update", "ms_per_update"),
    ("vs stock", "vs_stock"), ("MFU", "mfu"),
    ("device busy / wall (ms per update, profiled)", "busy_of_wall"),
    ("kernel launches per update", "launches"),
]
MEMORY_NAME = "gpu_memory_600m"
# in order of importance: the budget may end the list early
# first: the breakdown of part 1's NLLB-configs row, whose CUDA peak in the first run
# (6.61 GiB) was 1.05 above its prediction (that run kept a CPU dispatch meter on; on CPU the
# same step measures 6.13 GiB, as predicted there)
MEMORY_CONFIGURATIONS = ("nllb-settings+16-bit-state-one-rank", "stock-policy", "plugin",
                         "plugin+chunked-loss+ac",
                         "nllb-settings+16-bit-state",
                         "plugin+chunked-loss+ac+16-bit-vocab-reduce+vocab-gathered")
MEMORY_TIMEOUT = 60  # seconds at most per configuration (fewer when the budget is short)
# a log line of one of the plugin's loggers: fairseq's format ("... | INFO | name | message")
# or Python's default one ("INFO:name:message")
PLUGIN_LOG_LINE = re.compile(
    r"^(?:.*\| [A-Z]+ \| |[A-Z]+:)fairseq_shard_plugin[.\w]*(?: \||:)", re.MULTILINE)


class Deadline:
    def __init__(self, budget: float) -> None:
        self.end = time.monotonic() + budget

    def left(self) -> float:
        return self.end - time.monotonic()


def pad_dictionary(data: Path, size: int) -> None:
    """Append unused entries to the joined dictionary until it has ``size`` entries (fairseq
    adds 4 specials); the binarised data keep their indices."""
    for name in ("dict.src.txt", "dict.tgt.txt"):
        path = data / name
        lines = path.read_text().splitlines()
        extra = [f"madeupword{i:06d} 0" for i in range(size - 4 - len(lines))]
        path.write_text("\n".join(lines + extra) + "\n")


def predicted_peak_gib(output: str) -> float | None:
    """The plugin's start-up prediction (``predicted peak: 6.13 GiB per rank, ...``), in
    GiB; None for stock fairseq."""
    match = re.search(r"predicted peak: ([\d.]+) (GiB|MiB) per rank", output)
    if match is None:
        return None
    return round(float(match.group(1)) / (1024 if match.group(2) == "MiB" else 1), 3)


def describe_launcher(command: list[str]) -> str:
    """What started a run, read from the command the rank was started with."""
    args = command[1:]
    pairs = list(zip(args, args[1:], strict=False))
    user_dirs = [value for flag, value in pairs if flag == "--user-dir"]
    backends = [value for flag, value in pairs if flag == "--ddp-backend"]
    plugin = (f"--user-dir {Path(user_dirs[-1]).name}: plugin activated" if user_dirs
              else "no --user-dir: stock fairseq, no plugin hooks")
    return (f"{Path(command[0]).name} (fairseq_cli.train), {plugin}, "
            f"--ddp-backend {backends[-1] if backends else 'default'}")


@dataclass
class CommandSeen:
    """A run_training watcher that keeps the command its first rank was started with."""

    command: list[str] | None = None

    def __call__(self, ranks: list[subprocess.Popen], outputs: list[str]) -> None:
        if self.command is None and ranks:
            self.command = [str(part) for part in ranks[0].args]


def model_flops_per_update(words: float, sentences: float, layers: int = 12, dim: int = 1024,
                           ffn: int = 4096, vocabulary: int = NLLB_VOCABULARY) -> float:
    """Model FLOPs of one training update (forward and backward, 3x the forward; activation
    checkpointing's recomputation not counted, as MFU's convention has it) of the encoder-
    decoder transformer, for ``words`` target tokens in ``sentences`` sentences, source
    sentences taken as long as the target ones (the synthetic corpus draws both alike).
    Per token: 2 FLOPs per weight of every matrix it passes (encoder layers for source
    tokens; decoder layers and the output projection for target tokens), and 4 x length x
    dim per attention (scores and values) in each encoder self-, decoder self- and cross-
    attention."""
    length = words / max(sentences, 1.0)
    encoder_weights = layers * (4 * dim * dim + 2 * dim * ffn)
    decoder_weights = layers * (8 * dim * dim + 2 * dim * ffn) + dim * vocabulary
    attention = 4 * length * dim * 3 * layers
    forward = words * (2 * (encoder_weights + decoder_weights) + attention)
    return 3 * forward


def peak_flops() -> float | None:
    """The device's dense fp16 peak (``PEAK_FLOPS``), None for an unlisted device or no GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)


def steady_state(run: harness.RunResult, window: tuple[int, int] = STEADY) -> dict:
    """Words/s and ms per update over updates ``window`` (from fairseq's per-update ``wpb``
    and ``bsz`` and the launcher's optimizer-step times), and the model FLOPs per second."""
    starts = (run.memory[0] if run.memory else {}).get("update_starts") or []
    logged = {int(float(entry["num_updates"])): entry for entry in run.logs["train_inner"]
              if "num_updates" in entry}
    first, last = window
    if len(starts) < last or any(update not in logged for update in range(first, last + 1)):
        return {}
    seconds = window_seconds(starts, window)
    updates = range(first, last + 1)
    words = sum(float(logged[u]["wpb"]) for u in updates)
    sentences = sum(float(logged[u]["bsz"]) for u in updates)
    flops = model_flops_per_update(words, sentences)
    return {"steady_words_per_second": round(words / seconds, 1),
            "ms_per_update": round(1000 * seconds / len(updates), 1),
            "model_flops_per_second": flops / seconds}


def run_status(run: harness.RunResult, seconds: float, timeout: float) -> str:
    """``ok``, ``timed out after ...`` or ``failed (exit N)``."""
    if run.returncode == 0:
        return "ok"
    if seconds >= timeout - 1:
        return f"timed out after {timeout:.0f} s"
    return f"failed (exit {run.returncode})"


def window_seconds(starts: list[float], window: tuple[int, int]) -> float:
    """Wall seconds of updates ``window`` (first..last) from the optimizer steps' start
    times: update u's step starts at ``starts[u - 1]``, so those updates lie between the
    steps of update first - 1 and update last."""
    first, last = window
    return starts[last - 1] - starts[first - 2]


def check_data(name: str, dry_run: bool) -> tuple[Path, Path]:
    """A part's work folder and its data: the synthetic corpus with the dictionary padded
    to NLLB's vocabulary, or a tiny one in a temporary folder for a dry run."""
    from fairseq_shard_plugin.cli.synthetic_data import make_corpus

    if dry_run:
        work = Path(tempfile.mkdtemp(prefix=f"{name}_dry_"))
        data = make_corpus(work / "data", vocab=200, train=400, valid=20, max_len=12)
        pad_dictionary(data, 1000)
    else:
        work = REPO / "demo_work" / name
        data = make_corpus(work, vocab=16000, train=20000, valid=200, max_len=60)
        pad_dictionary(data, NLLB_VOCABULARY)
    return work, data


def on_cpu(flags: list[str]) -> list[str]:
    """A dry run's flags: CPU ranks compute in bf16, not fp16 (and keep fp32 moments)."""
    return [{"--memory-efficient-fp16": "--memory-efficient-bf16"}.get(flag, flag)
            for flag in flags if flag not in ("--fp16", "--fp16-adam-stats")]


def training_row(run_spec: Run, run: harness.RunResult | None, launcher: str,
                 seconds: float, timeout: float) -> dict:
    name, plugin = run_spec.name, run_spec.plugin
    if run is None:
        return {"run": name, "launcher": launcher, "status": "not started: no time left",
                "tokens": run_spec.tokens}
    memory = run.memory[0] if run.memory else {}
    plugin_lines = len(PLUGIN_LOG_LINE.findall(run.output))
    status = run_status(run, seconds, timeout)
    if not plugin and plugin_lines:
        status += f"; NOT STOCK: {plugin_lines} plugin log lines"
    losses = run.series("train_inner", "loss")

    def gib(key: str) -> float | None:
        return round(memory[key] / GIB, 2) if key in memory else None

    profile = memory.get("profile") or {}
    row = {
        "run": name, "launcher": launcher, "status": status, "returncode": run.returncode,
        "tokens": run_spec.tokens, "seconds": round(seconds, 1),
        "plugin_log_lines": plugin_lines,
        "cuda_peak_allocated_gib": gib("cuda_peak_allocated_bytes"),
        "cuda_peak_reserved_gib": gib("cuda_peak_reserved_bytes"),
        "predicted_peak_gib": predicted_peak_gib(run.output),
        "final_loss": losses[-1] if losses else None,
        "updates_logged": len(losses),
        "epoch_words_per_second": (run.series("train", "train_wps") or [None])[-1],
        "profile": profile or None,
        **steady_state(run),
    }
    if row["cuda_peak_allocated_gib"] is not None:
        row["cuda_peak_gib"] = f"{row['cuda_peak_allocated_gib']} / {row['cuda_peak_reserved_gib']}"
    if profile:
        row["busy_of_wall"] = (f"{profile['device_busy_ms_per_update']:.0f} / "
                               f"{profile['wall_ms_per_update']:.0f}")
        row["launches"] = profile["kernel_launches_per_update"]
    return row


def finish_rows(rows: list[dict], peak: float | None) -> None:
    """Speed relative to the stock row (the first run, at the same tokens), and MFU where the
    peak is known."""
    stock = next((row.get("steady_words_per_second") for row in rows
                  if row["run"] == RUNS[0].name), None)
    for row in rows:
        wps = row.get("steady_words_per_second")
        if wps and stock and row.get("tokens") == 4096:
            row["vs_stock"] = round(wps / stock, 2)
        if row.get("model_flops_per_second") and peak:
            row["mfu"] = f"{100 * row['model_flops_per_second'] / peak:.1f}%"


def selected_runs(first_run: int) -> tuple[str, list[Run]]:
    """The results' name and the runs from the ``first_run``-th of :data:`RUNS` (1-based)
    on, after the stock run, which every call measures for the ratios: a second call takes
    the runs a first one had no time for."""
    if first_run <= 1:
        return "gpu_check", list(RUNS)
    return f"gpu_check_from{first_run}", [RUNS[0], *RUNS[first_run - 1:]]


def trainings(budget: float, dry_run: bool, first_run: int = 1) -> None:
    """Part 1: the trainings, in order of importance (the budget may end the list early);
    results rewritten after each."""
    name, runs = selected_runs(first_run)
    deadline = Deadline(budget)
    work, data = check_data("gpu_check", dry_run)
    if dry_run:
        model, updates, window, profiled = (transformer_args(dim=32, ffn=64, layers=1, heads=2),
                                            8, (4, 7), (5, 6))
    else:
        model, updates, window, profiled = MODEL, STEADY[1], STEADY, PROFILED
    peak = None if dry_run else peak_flops()
    command = "bash benchmarks/gpu_check.sh" + (f" from {first_run}" if first_run > 1 else "")
    note = (f"Produced by `{command}` on one GPU: the NLLB-600M shape (12+12 "
            f"layers, d 1024, ffn 4096, vocabulary {NLLB_VOCABULARY:,}), world size 1, "
            f"{updates} updates, 4,096 tokens per update unless named. Steady state: words/s "
            f"and ms per update over updates {window[0]}-{window[1]} (the optimizer steps' "
            "start times, after the device finished its queued work); MFU: model FLOPs "
            "(`model_flops_per_update`) per second against the device's dense fp16 peak "
            f"({'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOPS'}). Profile "
            f"(`torch.profiler`) of updates {profiled[0]}-{profiled[1]}: the device's busy "
            "time (union of kernel intervals) against the wall time per update, and kernel "
            "launches per update; the top kernels are in `gpu_check.json`. No CPU tensor "
            "meter runs (it would put every operation through Python); CUDA peaks are "
            "maxima over the whole run.")
    measure_options = ("--profile-updates", f"{profiled[0]}-{profiled[1]}")
    rows: list[dict] = []
    for spec in runs:
        tag = f"run{len(rows)}"
        args = training_args(data, work / tag, max_update=updates,
                             max_tokens=256 if dry_run else spec.tokens, cpu=dry_run)
        args += model + spec.flags + ["--no-save", "--disable-validation"]
        if dry_run:  # CPU: no fp16 compute, gloo
            args = on_cpu(args)
            if not spec.plugin:
                args += ["--distributed-backend", "gloo"]
        timeout = min(RUN_TIMEOUT * (2 if spec.tokens > 4096 else 1), deadline.left())
        seen = CommandSeen()
        run, seconds = None, 0.0
        if timeout >= MINIMUM_RUN:
            start = time.monotonic()
            # cuda=True: stock fairseq runs under the measuring launcher itself (no
            # stock_launch.sh), with the row's --ddp-backend and no --user-dir
            run = run_training(args, nproc=1, plugin=spec.plugin,
                               measure_dir=work / tag / "memory",
                               stock_backend=spec.stock_backend,
                               cuda=True, timeout=timeout, check=False, watch=seen,
                               measure_options=measure_options,
                               environment=dict(spec.environment))
            seconds = time.monotonic() - start
        launcher = describe_launcher(seen.command) if seen.command else "not started"
        rows.append({**training_row(spec, run, launcher, seconds, timeout),
                     "plugin": spec.plugin})
        if dry_run and run is not None:
            rows[-1].update(steady_state(run, window))
        if run is not None and run.returncode != 0:
            (work / f"{tag}.log").write_text(run.output)
            rows[-1]["error_tail"] = run.output[-2000:]
        print(f"gpu_check: {spec.name}: {rows[-1]['status']} ({seconds:.0f} s)", flush=True)
        finish_rows(rows, peak)
        for row in rows:
            for _, key in TRAINING_COLUMNS:
                row.setdefault(key, None)
        finished = sum(row["status"] == "ok" for row in rows)
        partial = ("" if len(rows) == len(runs) else
                   f" Partial: {len(rows)} of {len(runs)} runs so far.")
        table = write_results(name, rows, TRAINING_COLUMNS,
                              f"{note} {finished} of {len(runs)} runs finished.{partial}")
    print(table)


def memory_options(dry_run: bool) -> list[str]:
    """``benchmarks.memory``'s arguments for part 2 (a tiny model on CPU for a dry run)."""
    if dry_run:
        return ["--model", "--arch transformer --encoder-layers 1 --decoder-layers 1 "
                "--encoder-embed-dim 32 --decoder-embed-dim 32 --encoder-ffn-embed-dim 64 "
                "--decoder-ffn-embed-dim 64 --encoder-attention-heads 2 "
                "--decoder-attention-heads 2", "--vocabulary", "1000", "--tokens", "64",
                "--sentence", "16", "--precision", "fp32", "--loss-chunk-tokens", "32"]
    return ["--cuda"]


def memory_part(budget: float, dry_run: bool) -> None:
    """Part 2: one fresh process per configuration (``memory-one``); results rewritten
    after each."""
    from benchmarks import memory

    deadline = Deadline(budget)
    arguments = memory_options(dry_run)
    options = memory.parse_options(arguments)
    by_name = {c.name: c for c in (*memory.CONFIGURATIONS, *memory.OPTIONAL_CONFIGURATIONS)}
    results: list[dict] = []
    for name in MEMORY_CONFIGURATIONS:
        config = by_name[name]
        timeout = min(MEMORY_TIMEOUT, deadline.left())
        failed = {"configuration": name, "description": config.description,
                  "world_size": config.world_size or options.world_size}
        start = time.monotonic()
        if timeout < MINIMUM_RUN:
            results.append({**failed, "error": "not started: no time left"})
        else:
            command = [sys.executable, "-m", "benchmarks.gpu_check", "memory-one", *arguments,
                       "--only", name]
            try:
                completed = subprocess.run(command, capture_output=True, text=True,
                                           timeout=timeout, cwd=REPO)
            except subprocess.TimeoutExpired:
                results.append({**failed, "error": f"timed out after {timeout:.0f} s"})
            else:
                if completed.returncode == 0:
                    results.append(json.loads(completed.stdout.strip().splitlines()[-1]))
                else:
                    killed = " (killed: out of host memory?)" if completed.returncode == -9 else ""
                    results.append({**failed,
                                    "error": f"failed (exit {completed.returncode}){killed}",
                                    "error_tail": completed.stderr[-2000:]})
        status = results[-1].get("error") or f"peak {results[-1]['peak_gib']:.2f} GiB per rank"
        print(f"gpu_check memory: {name}: {status} ({time.monotonic() - start:.0f} s)",
              flush=True)
        table = write_memory_results(memory, options, results, dry_run)
    print(table)


def write_memory_results(memory: object, options: argparse.Namespace, results: list[dict],
                         dry_run: bool) -> str:
    measured = [row for row in results if "error" not in row]
    rows = memory.table_rows(measured) + [
        {**dict.fromkeys(key for _, key in memory.COLUMNS),
         "configuration": f"{row['configuration']} ({row['error']})",
         "world_size": row["world_size"]}
        for row in results if "error" in row]
    device = "cpu (dry run)" if dry_run else "cuda"
    note = (f"GiB per rank, {options.tokens} tokens per rank, {options.precision} compute, "
            f"fp32 master shards, Adam, measured on {device} with a fake process group "
            f"(fairseq's CUDA gradient-norm consistency check off: a fake group's all-reduce "
            f"leaves the other rank's slot empty); device: the peak without the host-side "
            f"state of --cpu-offload. Produced by `bash benchmarks/gpu_check.sh` "
            f"(`python -m benchmarks.gpu_check memory`: `benchmarks.memory "
            f"{' '.join(memory_options(dry_run)) if not dry_run else '(tiny model)'}` "
            f"per configuration). {len(measured)} of {len(MEMORY_CONFIGURATIONS)} "
            f"configurations measured.")
    if len(results) < len(MEMORY_CONFIGURATIONS):
        note += f" Partial: {len(results)} of {len(MEMORY_CONFIGURATIONS)} so far."
    if memory.draw_chart(measured, harness.RESULTS / f"{MEMORY_NAME}.png"):
        note += f" Chart: `benchmarks/results/{MEMORY_NAME}.png`."
    table = write_results(MEMORY_NAME, rows, memory.COLUMNS, note)
    (harness.RESULTS / f"{MEMORY_NAME}.json").write_text(json.dumps(results, indent=2) + "\n")
    return table


def memory_one(argv: list[str]) -> None:
    """One configuration of ``benchmarks.memory`` (``--only``), its trainer without the
    CUDA gradient-norm check that a fake process group cannot pass (module docstring)."""
    from benchmarks import memory

    on_fake_group = memory.trainer_on_fake_group

    def without_grad_norm_check(fairseq_args: list[str], world_size: int) -> object:
        trainer = on_fake_group(fairseq_args, world_size)
        trainer._grad_norm_buf = None  # as fairseq's Trainer leaves it on CPU or one rank
        return trainer

    memory.trainer_on_fake_group = without_grad_norm_check
    memory.main(argv)


def parse_part_options(parser: argparse.ArgumentParser, argv: list[str], budget: float,
                       name: str) -> argparse.Namespace:
    """A part's ``--budget`` and ``--dry-run`` (whose results go to a temporary folder)."""
    parser.add_argument("--budget", type=float, default=budget,
                        help="seconds for the part: no run starts past it")
    parser.add_argument("--dry-run", action="store_true",
                        help="on CPU with a tiny model, results in a temporary directory")
    options = parser.parse_args(argv)
    if options.dry_run:
        harness.RESULTS = Path(tempfile.mkdtemp(prefix=f"{name}_results_"))
        print(f"{name}: dry run, results in {harness.RESULTS}", flush=True)
    return options


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["memory-one"]:
        memory_one(argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", nargs="?", choices=("trainings", "memory"), default="trainings")
    parser.add_argument("--from-run", type=int, default=1,
                        help="trainings from this run of the list on (1-based), after the "
                        "stock run: results in gpu_check_fromN.*")
    options = parse_part_options(parser, argv, len(RUNS) * RUN_TIMEOUT, "gpu_check")
    if options.part == "memory":
        memory_part(options.budget, options.dry_run)
    else:
        trainings(options.budget, options.dry_run, options.from_run)


if __name__ == "__main__":
    main()
