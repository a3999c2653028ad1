"""Launch fairseq trainings on CPU ranks (plugin or stock) and read their logs back.

Shared by the tests and the benchmarks so both run trainings exactly the same way.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from launching import forkserver

REPO = Path(__file__).resolve().parents[1]
PLUGIN_DIR = REPO / "fairseq_shard_plugin"
STOCK_LAUNCH = REPO / "launching" / "stock_launch.sh"
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """A console script next to this Python, else the first one on PATH."""
    beside = BIN / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found beside {sys.executable} or on PATH")
    return found
# fairseq's "| INFO | train_inner | {...}", Python's default "INFO:train_inner:{...}", or
# Hydra's "[time][train_inner][INFO] - {...}"
LOG_LINE = re.compile(
    r"(?:\| |INFO:|\]\[)(train_inner|train|valid)(?: \| |:|\]\[INFO\] - )(\{.*\})\s*$"
)


def rank_environment(threads: int | None = 1) -> dict[str, str]:
    """This process's environment for a launched rank or tool: this Python's console
    scripts first on PATH, unbuffered output, and ``threads`` OpenMP threads (one, as
    torchrun gives each rank; None leaves the variable as it is)."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONUNBUFFERED="1")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


_PORTS_GIVEN: set[int] = set()
_PORTS_LOCK = threading.Lock()
_PORT_DRAW = random.SystemRandom()  # not the global generator, which code under test seeds


def free_port() -> int:
    """A free port for a launch's rendezvous, never the same twice in this process, and
    outside the kernel's ephemeral range: a port that ``bind(0)`` handed out and released
    could become any outgoing connection's source port (another launch's ranks connecting
    to their own store) before this launch's rank 0 binds it."""
    low, high = _ephemeral_ports()
    choices = range(10000, low) if low > 12000 else range(high + 1, 65536)
    with _PORTS_LOCK:
        for _ in range(1000):
            port = _PORT_DRAW.choice(choices)
            if port in _PORTS_GIVEN:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _PORTS_GIVEN.add(port)
            return port
    raise RuntimeError(f"no free port in {choices}")


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux; its default
    elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def transformer_args(dim: int, ffn: int, layers: int, heads: int = 4) -> list[str]:
    """A pre-norm transformer with all embeddings shared, as in the NLLB recipes."""
    return [
        "--arch", "transformer", "--share-all-embeddings",
        "--encoder-normalize-before", "--decoder-normalize-before",
        "--encoder-layers", str(layers), "--decoder-layers", str(layers),
        "--encoder-embed-dim", str(dim), "--decoder-embed-dim", str(dim),
        "--encoder-ffn-embed-dim", str(ffn), "--decoder-ffn-embed-dim", str(ffn),
        "--encoder-attention-heads", str(heads), "--decoder-attention-heads", str(heads),
        "--dropout", "0.0",
    ]


def training_args(
    data: Path, save_dir: Path, max_update: int, max_tokens: int = 512, seed: int = 1,
    cpu: bool = True,
) -> list[str]:
    """fp32 Adam with label smoothing, one JSON log line per update."""
    return [
        str(data), *(["--cpu"] if cpu else []), "--save-dir", str(save_dir),
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "1e-3",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--max-tokens", str(max_tokens), "--max-update", str(max_update),
        "--seed", str(seed), "--clip-norm", "1.0",
        "--log-format", "json", "--log-interval", "1", "--num-workers", "0",
        # no prefetch thread: where training stops inside an epoch (--max-update), fairseq's
        # thread was still loading batches at interpreter exit and a rank could abort
        # ("terminate called without an active exception", -6; stock fairseq's runs too);
        # the batches and their order are the same without it
        "--data-buffer-size", "0",
    ]


def _aborted_after_training(returncode: int, output: str, nproc: int) -> bool:
    """Whether stock fairseq's ranks (the tests' reference, never the plugin) finished
    training (rank 0 logs it; the ranks' last updates are collectives, so all did) and one
    then aborted in the interpreter's exit: "terminate called without an active exception"
    (SIGABRT) from a C++ thread of torch's torn down while joinable, seen in about one stock
    gloo run in a few hundred here (a CI run, session 26), never in the plugin's."""
    return (returncode == -signal.SIGABRT and nproc > 1
            and "| fairseq_cli.train | done training in " in output
            and "terminate called without an active exception" in output)


# Called while ranks run with the processes and each one's output so far (e.g. to signal
# one of them at a given point of the training).
Watcher = Callable[[list[subprocess.Popen], list[str]], None]


@dataclass
class RunResult:
    returncode: int
    output: str
    logs: dict[str, list[dict]] = field(default_factory=dict)
    memory: list[dict] = field(default_factory=list)  # per rank, from the measured run

    def series(self, kind: str, key: str) -> list[float]:
        return [float(entry[key]) for entry in self.logs.get(kind, []) if key in entry]


def parse_logs(output: str) -> dict[str, list[dict]]:
    logs: dict[str, list[dict]] = {"train_inner": [], "train": [], "valid": []}
    for line in output.splitlines():
        match = LOG_LINE.search(line)
        if match:
            logs[match.group(1)].append(json.loads(match.group(2)))
    return logs


def run_training(
    args: list[str],
    nproc: int,
    plugin: bool,
    measure_dir: Path | None = None,
    timeout: float = 600,
    check: bool = True,
    stock_backend: str = "legacy_ddp",
    cuda: bool = False,
    watch: Watcher | None = None,
    measure_options: tuple[str, ...] = (),
    environment: dict[str, str] | None = None,
) -> RunResult:
    """Train on ``nproc`` ranks: the plugin with fully_sharded, or stock fairseq.

    The ranks are started as torchrun starts its workers (:func:`start_ranks`). On CPU,
    stock fairseq runs through ``stock_launch.sh`` (gloo); with ``cuda`` it is launched like
    the plugin, with ``--ddp-backend stock_backend`` (e.g. ``fully_sharded``, fairseq's own
    fairscale path).

    With ``measure_dir`` every rank runs under ``fairseq-shard-measure-train`` (with
    ``measure_options``) and what it measured (the whole-process peak of live tensor bytes,
    update times, ...) is returned in ``RunResult.memory``. ``environment`` adds variables
    to the ranks' environment.
    """
    env = {**rank_environment(), **(environment or {})}
    measure = (
        ["--measure-out", str(measure_dir / "rank{rank}.json"), *measure_options]
        if measure_dir else []
    )
    entry = [tool("fairseq-shard-measure-train"), *measure] if measure_dir else [
        tool("fairseq-train")]
    if plugin:
        command = [*entry, *args, "--user-dir", str(PLUGIN_DIR), "--ddp-backend", "fully_sharded"]
    elif cuda:
        command = [*entry, *args, "--ddp-backend", stock_backend]
    else:
        if measure_dir:
            env["FAIRSEQ_TRAIN"] = " ".join(["fairseq-shard-measure-train", *measure])
        command = [str(STOCK_LAUNCH), *args, "--ddp-backend", stock_backend]
    returncode, output = start_ranks(command, nproc, env, timeout=timeout, watch=watch)
    if not plugin and not cuda and _aborted_after_training(returncode, output, nproc):
        returncode = 0  # the reference's results are all there (see the function)
    if check and returncode != 0:
        raise RuntimeError(f"training failed ({returncode}):\n{output[-6000:]}")
    memory = []
    if measure_dir:
        memory = [json.loads(p.read_text()) for p in sorted(measure_dir.glob("rank*.json"))]
    return RunResult(returncode, output, parse_logs(output), memory)


TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "MASTER_ADDR", "MASTER_PORT")


def _read_so_far(output: IO[bytes]) -> str:
    return os.pread(output.fileno(), os.fstat(output.fileno()).st_size, 0).decode(
        errors="replace")


def wait_for_ranks(
    ranks: list[subprocess.Popen], outputs: list[IO[bytes]], timeout: float, grace: float = 20,
    watch: Watcher | None = None,
) -> tuple[list[int], list[str]]:
    """Wait for every rank; once one fails, the others get ``grace`` seconds to finish
    (they may be blocked in a collective with it) before they are killed, as torchrun does.
    Returns each rank's exit code and output."""
    deadline = time.monotonic() + timeout
    while any(rank.poll() is None for rank in ranks) and time.monotonic() < deadline:
        if any(rank.returncode for rank in ranks):
            deadline = min(deadline, time.monotonic() + grace)
        if watch is not None:
            watch(ranks, [_read_so_far(output) for output in outputs])
        time.sleep(0.05)
    for rank in ranks:
        if rank.poll() is None:
            rank.kill()
            rank.wait()
    texts = []
    for output in outputs:
        output.seek(0)
        texts.append(output.read().decode(errors="replace"))
        output.close()
    return [rank.returncode for rank in ranks], texts


def start_ranks(
    command: list[str], nproc: int, env: dict[str, str], cwd: Path | list[Path] = REPO,
    timeout: float = 600, watch: Watcher | None = None,
) -> tuple[int, str]:
    """Run ``command`` as ``nproc`` ranks on this machine with the variables torchrun gives
    its workers (``TORCHRUN_VARIABLES``), but without torchrun's agent process, whose own
    start-up (it imports torch before starting any rank) would add seconds to every test
    launch. The commands documented for users run under torchrun itself in test_hydra,
    test_checkpoints (the crash helper) and test_hybrid_offload (two torchrun "nodes").

    ``cwd`` may be a list: each rank's working directory. Returns the first failing exit
    code (or 0) and the ranks' outputs, rank 0 first.
    """
    cwds = cwd if isinstance(cwd, list) else [cwd] * nproc
    port = str(free_port())
    outputs = [tempfile.TemporaryFile() for _ in range(nproc)]
    ranks = [
        forkserver.start(command, dict(
            env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port), cwds[rank], output)
        for rank, output in enumerate(outputs)
    ]
    codes, texts = wait_for_ranks(ranks, outputs, timeout, watch=watch)
    return next((code for code in codes if code), 0), "".join(texts)


def run_helper(script: Path, *args: str, nproc: int = 2,
               environment: dict[str, str] | None = None, timeout: float = 300) -> str:
    """Run a helper script of the tests as ``nproc`` ranks (:func:`start_ranks`); the ranks'
    output, after checking that every rank succeeded."""
    env = {**rank_environment(), **(environment or {})}
    code, output = start_ranks([sys.executable, str(script), *args], nproc, env,
                               timeout=timeout)
    if code != 0:
        raise RuntimeError(f"{script.name} failed ({code}):\n{output[-6000:]}")
    return output


def run_like_srun(command: list[str], ranks: int, cwd: Path = REPO) -> list[str]:
    """Start ``command`` once per rank the way ``srun --ntasks-per-node N`` does: only
    Slurm's variables (no torchrun's), one node here; every rank's output, after checking
    that each succeeded. The command picks its own rendezvous port."""
    env = {k: v for k, v in rank_environment().items() if k not in TORCHRUN_VARIABLES}
    env.update(SLURM_NTASKS=str(ranks), SLURM_NODEID="0", SLURM_JOB_NODELIST="127.0.0.1",
               SLURM_TASKS_PER_NODE=str(ranks), SLURM_JOB_ID="1")
    outputs = [tempfile.TemporaryFile() for _ in range(ranks)]
    tasks = [
        forkserver.start(command, dict(env, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank)),
                         cwd, output)
        for rank, output in enumerate(outputs)
    ]
    codes, texts = wait_for_ranks(tasks, outputs, timeout=600)
    for code, output in zip(codes, texts, strict=True):
        if code != 0:
            raise RuntimeError(f"a rank failed ({code}):\n{output[-6000:]}")
    return texts


class _Started:
    """A command started with its stdout and stderr going to temporary files."""

    def __init__(self, command: list[str], cwd: Path, env: dict[str, str] | None) -> None:
        self.command = command
        self.stdout, self.stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self.process = forkserver.start(command, dict(os.environ if env is None else env), cwd,
                                        self.stdout, self.stderr)

    def finish(self, timeout: float) -> subprocess.CompletedProcess:
        try:
            self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        texts = []
        for stream in (self.stdout, self.stderr):
            stream.seek(0)
            texts.append(stream.read().decode(errors="replace"))
            stream.close()
        return subprocess.CompletedProcess(self.command, self.process.returncode, *texts)


def run_command(command: list[str], cwd: Path = REPO, env: dict[str, str] | None = None,
                timeout: float = 300) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)``, started through the
    fork server when the tests enable it (:mod:`.forkserver`)."""
    return _Started(command, cwd, env).finish(timeout)


def run_concurrently(
    commands: dict[str, list[str]], cwd: Path = REPO, timeout: float = 300
) -> dict[str, subprocess.CompletedProcess]:
    """Start every command at once and wait for all; each one's result by name. Short
    commands spend most of their time starting Python, torch and fairseq, which overlaps."""
    started = {name: _Started(command, cwd, None) for name, command in commands.items()}
    return {name: process.finish(timeout) for name, process in started.items()}


def in_threads(jobs: dict[str, Callable[[], Any]], workers: int = 2) -> dict[str, Any]:
    """Run ``jobs`` (each starts trainings or other processes) ``workers`` at a time; each
    job's result by name, or the exception it raised. Launches spend much of their time
    starting Python, torch and fairseq, which overlaps well on 2 cores; measured memory is
    per process and unaffected (time is, so benchmarks of speed keep ``workers=1``)."""
    def outcome(job: Callable[[], Any]) -> Any:
        try:
            return job()
        except Exception as error:  # handed to the caller with the job's name
            return error

    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {name: pool.submit(outcome, job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def result_of(results: dict[str, Any], name: str) -> Any:
    """One job's result from :func:`in_threads`, its exception raised here."""
    result = results[name]
    if isinstance(result, Exception):
        raise result
    return result


RESULTS = REPO / "benchmarks" / "results"


def write_results(
    name: str, rows: list[dict], columns: list[tuple[str, str]], note: str
) -> str:
    """Write ``benchmarks/results/NAME.json`` and a Markdown table ``NAME.md``; return it.

    ``columns`` are (header, row key) pairs; ``note`` follows the table (the command).
    Missing values (None) read "n/a" in the table and null in the JSON.
    """
    header = "| " + " | ".join(title for title, _ in columns) + " |\n"
    header += "|" + "---|" * len(columns) + "\n"
    body = "".join(
        "| " + " | ".join("n/a" if row[key] is None else str(row[key]) for _, key in columns)
        + " |\n" for row in rows
    )
    table = f"{header}{body}\n{note}\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(table)
    (RESULTS / f"{name}.json").write_text(json.dumps(rows, indent=2) + "\n")
    return table
