"""Start test ranks by forking a Python that has already imported fairseq.

Every rank of every test launch is a fresh Python that imports torch and fairseq before it
does anything (about 3.5 s of CPU, a third of it scikit-learn, which fairseq's
audio_classification task imports); on 2 cores that start-up was half of ``make test``.
A fork server imports ``fairseq_cli.train`` (and the torch packages a sharded run loads:
FSDP2, dynamo, DCP) once and forks a process per rank: each rank is still a separate
process with its own environment, working directory, output file and process group
rendezvous, and runs the same console script or helper file, from the point where it
would have finished importing. The plugin itself is never imported by the
server (fairseq 0.12 skips a ``--user-dir`` already in ``sys.modules``), so each rank loads
it exactly as a user's run does.

What differs from a fresh process: the preloaded modules were imported under the
server's environment (``OMP_NUM_THREADS=1``, as every test launch sets), and all ranks
share the server's hash seed. Benchmarks never use it (their memory and time figures come
from fresh processes); tests opt in with ``FAIRSEQ_SHARD_TEST_FORKSERVER=1``, and on a
machine with a CUDA device every process starts fresh (a fork cannot use CUDA once the
process it was forked from has touched it).

Protocol, one connection per process: the client sends a JSON request (argv, env, cwd)
with its output file descriptor attached; a per-process monitor forked from the server
replies with the process id, then with the exit status once the process ends
(negative: killed by that signal, as ``subprocess.Popen.returncode``).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

ENABLE_VARIABLE = "FAIRSEQ_SHARD_TEST_FORKSERVER"
# fairseq's training entry, and the torch packages a sharded run imports once the plugin
# loads (about 1.4 s of CPU per rank: FSDP2 and the dynamo package it pulls in, DCP)
_PRELOAD = ("fairseq_cli.train", "torch.distributed.fsdp", "torch._dynamo",
            "torch.distributed.checkpoint", "torch.distributed.tensor")
_MAX_REQUEST = 1 << 20


def _exit_code(error: SystemExit) -> int:
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _is_this_python(program: str) -> bool:
    """Whether ``program`` names this interpreter (``venv/../venv/bin/python`` too)."""
    return os.path.abspath(program) == os.path.abspath(sys.executable)


def _run_entry(argv: list[str]) -> int:
    """Run ``argv`` as the command line would, in this (forked) process; its exit code."""
    python = _is_this_python(argv[0])
    if python and argv[1:2] == ["-c"]:
        sys.argv = ["-c", *argv[3:]]
        sys.path[0] = ""
        code = compile(argv[2], "<string>", "exec")
        run = lambda: exec(code, {"__name__": "__main__"})  # noqa: E731
    elif python and argv[1:2] == ["-m"]:
        sys.argv = [argv[2], *argv[3:]]
        sys.path[0] = os.getcwd()
        run = lambda: runpy.run_module(argv[2], run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        script = argv[1] if python else argv[0]
        sys.argv = argv[1:] if python else list(argv)
        sys.path[0] = str(Path(script).resolve().parent)
        run = lambda: runpy.run_path(script, run_name="__main__")  # noqa: E731
    try:
        run()
        return 0
    except SystemExit as error:
        return _exit_code(error)
    except BaseException:  # printed as the interpreter would (torch.distributed installs
        try:  # a hook prefixing each line with the rank)
            sys.excepthook(*sys.exc_info())
        except BaseException:  # that hook raises where stderr cannot be written: the
            pass  # interpreter's exit status is still 1
        return 1


def _become_rank(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked rank: take the request's environment and outputs, run, exit."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # not the server's pipe
    os.dup2(fds[0], 1)
    os.dup2(fds[-1], 2)  # stderr: its own file, or the same as stdout
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # read TMPDIR again, as a new process does
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # the command, what a normal interpreter exit does, then exit without tearing down the
    # heap, whatever escapes: a rank that ran on into the server's loop was seen to abort
    # in its teardown (SIGABRT, a CI run)
    code = 1
    try:
        code = _run_entry(request["argv"])
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed stream: nothing left to flush
                pass
        os._exit(code)


def _monitor(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """In a process forked per request: fork the rank, report its pid and exit status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _become_rank(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)


def serve(path: str) -> None:
    """Preload fairseq, then fork one monitored process per connection, until the test
    process ends: its end closes this server's stdin (a pipe from it), even when it is
    killed before its exit handlers run."""
    for module in _PRELOAD:
        __import__(module)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            os.unlink(path)
            return
        if listener not in readable:
            continue
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 2)
        while chunk := conn.recv(_MAX_REQUEST):  # the client closes its side after sending
            message += chunk
        if os.fork() == 0:
            listener.close()
            _monitor(conn, json.loads(message), fds)
        conn.close()
        for fd in fds:
            os.close(fd)


class ForkedProcess:
    """The client's handle on a forked process, with the part of ``subprocess.Popen``'s
    interface the test harness uses."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._buffer = b""
        self.pid = int(self._read_line(timeout=None))
        self.returncode: int | None = None

    def _read_line(self, timeout: float | None) -> str | None:
        self._conn.settimeout(timeout)
        while b"\n" not in self._buffer:
            try:
                chunk = self._conn.recv(64)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:
                raise ConnectionError("the fork server's monitor went away")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._read_line(timeout=0)
            if line is not None:
                self.returncode = int(line)
                self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._read_line(timeout=timeout)
            if line is None:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            self.returncode = int(line)
            self._conn.close()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """A running fork server, started on first use and stopped at exit."""

    def __init__(self) -> None:
        directory = Path(os.environ.get("TMPDIR", "/tmp"))
        self.path = str(directory / f"fairseq-shard-forkserver-{os.getpid()}.sock")
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                   MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self._server = subprocess.Popen(
            [sys.executable, "-m", "launching.forkserver", self.path], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, cwd=Path(__file__).resolve().parents[1])
        assert self._server.stdout is not None
        for line in self._server.stdout:  # fairseq's imports log a line or two first
            if line.strip() == b"ready":
                break
        else:
            raise RuntimeError("the fork server did not start")
        atexit.register(self.stop)

    def start(self, argv: list[str], env: dict[str, str], cwd: Path | str,
              output: IO[bytes], errors: IO[bytes] | None = None) -> ForkedProcess:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}).encode()
        streams = [output] if errors is None else [output, errors]
        socket.send_fds(conn, [request], [stream.fileno() for stream in streams])
        conn.shutdown(socket.SHUT_WR)
        return ForkedProcess(conn)

    def stop(self) -> None:
        self._server.kill()
        self._server.wait()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


_server: ForkServer | None = None
_lock = threading.Lock()


def can_fork(argv: list[str]) -> bool:
    """Whether ``argv`` runs Python code the server can run: a console script of this
    Python, or this Python with a script, ``-m module`` or ``-c code``; never on a machine
    with a CUDA device, where a fork of a process that has touched CUDA cannot use it."""
    if os.environ.get(ENABLE_VARIABLE) != "1" or not argv or _has_cuda_device():
        return False
    if _is_this_python(argv[0]):
        return len(argv) > 2 and (argv[1] in ("-c", "-m") or argv[1].endswith(".py"))
    try:
        with open(argv[0], "rb") as script:
            first_line = script.readline()
    except OSError:
        return False
    shebang = first_line.strip()
    return shebang.startswith(b"#!") and _is_this_python(os.fsdecode(shebang[2:]))


def _has_cuda_device() -> bool:
    import torch

    return torch.cuda.is_available()


def start(argv: list[str], env: dict[str, str], cwd: Path | str, output: IO[bytes],
          errors: IO[bytes] | None = None) -> Any:
    """``argv`` as a forked process if :func:`can_fork`, else as a ``subprocess.Popen``;
    its stdout goes to ``output``, its stderr to ``errors`` (None: to ``output`` too)."""
    global _server
    if not can_fork(argv):
        return subprocess.Popen(argv, cwd=cwd, stdout=output, env=env,
                                stderr=subprocess.STDOUT if errors is None else errors)
    with _lock:
        if _server is None:
            _server = ForkServer()
    return _server.start(argv, env, cwd, output, errors)


if __name__ == "__main__":
    serve(sys.argv[1])
