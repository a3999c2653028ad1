"""The C host Adam step (sharding/native_adam.c): torch's fused kernel bit for bit, on any
thread count, and a one-line fallback to torch where it cannot be built."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fairseq_shard_plugin.sharding import native_adam, sharded_adam
from fairseq_shard_plugin.sharding.native_adam import native_library
from fairseq_shard_plugin.sharding.sharded_adam import ShardedAdam
from launching.harness import REPO

SHAPES = [(96, 48), (4096,), (0, 8), (16,)]  # multiples of 16: torch's vector path only
SETTINGS = dict(lr=1e-3, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler here")


def run(dtype: torch.dtype, native: bool, fp16_moments: bool = False, threads: int = 1,
        steps: int = 6, factor: float = 1 / 512, shapes: list[tuple[int, ...]] = SHAPES,
        grad_size: float = 1e-3) -> tuple[list[torch.Tensor], ShardedAdam]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=generator).to(dtype).requires_grad_()
              for shape in shapes]
    optimizer = ShardedAdam(params, fp16_moments=fp16_moments, native=native, **SETTINGS)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(steps):
            for param in params:
                param.grad = (torch.randn(param.shape, generator=generator) * grad_size
                              / factor).to(dtype)
            optimizer.step(grad_factor=factor)
    finally:
        torch.set_num_threads(previous)
    return params, optimizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_parameters_update_as_torchs_fused_kernel_bit_for_bit(dtype: torch.dtype) -> None:
    """fp32 moments: the C step and torch's kernel (over fp32 copies of 16-bit tensors)
    give the same bits."""
    ours, native = run(dtype, native=True)
    reference, torch_step = run(dtype, native=False)
    for a, b in zip(ours, reference, strict=True):
        assert torch.equal(a, b)
        if a.numel():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(native.state[a][key], torch_step.state[b][key])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scaled_moments_agree_with_the_torch_step(dtype: torch.dtype) -> None:
    """Scaled fp16 moments: the same parameters within one 16-bit rounding, and stored
    moments within one fp16 step of the largest (torch's scales pass rounds differently)."""
    ours, native = run(dtype, native=True, fp16_moments=True)
    reference, torch_step = run(dtype, native=False, fp16_moments=True)
    for a, b in zip(ours, reference, strict=True):
        if not a.numel():
            continue
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2 if dtype != torch.float32
                                   else 1e-5, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            ours_stored, torch_stored = native.state[a][key], torch_step.state[b][key]
            assert ours_stored.dtype == torch.float16
            assert float((ours_stored.float() - torch_stored.float()).abs().max()) <= 32
            assert native.state[a][f"{key}_scale"] == pytest.approx(
                torch_step.state[b][f"{key}_scale"], rel=1e-5)


def test_scaled_moments_fill_fp16_exactly_to_its_largest_value() -> None:
    """The scale comes from the moments as stored (one pass computes them both times):
    the largest stored magnitude is fp16's largest, never infinite (gradients large enough
    for the scale's 1e-8 term not to matter)."""
    params, optimizer = run(torch.bfloat16, native=True, fp16_moments=True, factor=1.0,
                            grad_size=10.0)
    for param in params[:2]:
        for key in ("exp_avg", "exp_avg_sq"):
            stored = optimizer.state[param][key].float()
            assert torch.isfinite(stored).all()
            assert float(stored.abs().max()) == pytest.approx(65504, rel=1e-3)


def test_threads_split_the_work_without_changing_a_bit() -> None:
    big = [(1 << 18,), (3, 5)]  # large enough to be split over threads
    (one, first), (two, second) = (
        run(torch.bfloat16, native=True, fp16_moments=True, threads=threads, steps=2,
            shapes=big) for threads in (1, 2))
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(first.state[a]["exp_avg"], second.state[b]["exp_avg"])
        assert first.state[a]["exp_avg_scale"] == second.state[b]["exp_avg_scale"]


def _step_in_a_fresh_process(tmp_path: Path, **environment: str) -> subprocess.CompletedProcess:
    script = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
        "from fairseq_shard_plugin.sharding.sharded_adam import ShardedAdam\n"
        "p = torch.zeros(64, dtype=torch.bfloat16, requires_grad=True)\n"
        "o = ShardedAdam([p], fp16_moments=True)\n"
        "p.grad = torch.ones_like(p)\n"
        "o.step()\n"
        "print(f'updated {float(p.float().mean()):.4f}')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           **environment}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120, check=True)


def test_without_a_compiler_the_step_runs_in_torch_and_says_so_once(tmp_path: Path) -> None:
    done = _step_in_a_fresh_process(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert "updated -0.0010" in done.stdout
    warnings = [line for line in done.stderr.splitlines() if "C compiler" in line]
    assert len(warnings) == 1 and "install gcc" in warnings[0]


def test_a_compiler_command_with_arguments_builds_the_library(tmp_path: Path) -> None:
    """CC="ccache gcc" (make's convention) was looked up as one program, reported missing,
    and the step ran in torch."""
    done = _step_in_a_fresh_process(tmp_path, CC="env LC_ALL=C cc")
    assert "updated -0.0010" in done.stdout
    assert "C compiler" not in done.stderr and "could not build" not in done.stderr
    assert len(list((tmp_path / "cache" / "fairseq_shard_plugin").glob("*.so"))) == 1


def test_a_cache_folder_that_is_a_symlink_is_never_used(tmp_path: Path) -> None:
    """Someone else's folder could hold a library that is not ours: not loaded, not
    written; one line, and the step runs in torch."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "fairseq_shard_plugin").symlink_to(elsewhere)
    done = _step_in_a_fresh_process(tmp_path)
    assert "updated -0.0010" in done.stdout
    assert "is not a private folder" in done.stderr
    assert list(elsewhere.iterdir()) == []


def test_the_library_is_built_once_per_cache_and_reused(tmp_path: Path) -> None:
    _step_in_a_fresh_process(tmp_path)
    built = list((tmp_path / "cache" / "fairseq_shard_plugin").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    modified = built[0].stat().st_mtime_ns
    _step_in_a_fresh_process(tmp_path)
    assert [p.stat().st_mtime_ns for p in built] == [modified]


@pytest.fixture(scope="module", params=["x86-64", "haswell"])
def portable_library(request: pytest.FixtureRequest,
                     tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The same source built for any x86-64 (no AVX2): its one-value-at-a-time loops,
    which CPUs without the vector instructions run (on this CPU only the tails do); and
    for AVX2 without AVX-512: its 8-wide loops, which an AVX-512 CPU's build never runs."""
    if platform.machine() != "x86_64":
        pytest.skip("the portable builds are checked on x86-64")
    if request.param == "haswell" and not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("this CPU cannot run an AVX2 build")
    path = tmp_path_factory.mktemp(request.param) / "native_adam.so"
    flags = [flag for flag in native_adam.FLAGS if flag != "-march=native"]
    subprocess.run(["cc", *flags, f"-march={request.param}", "-o", str(path),
                    str(native_adam.SOURCE)], check=True, capture_output=True)
    library = ctypes.CDLL(str(path))
    for name in ("adam_moment_maxima", "adam_update"):
        getattr(library, name).restype = ctypes.c_int
    return library


def _cpu_flags() -> set[str]:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return {flag for line in lines if line.startswith("flags") for flag in line.split()}


@pytest.mark.parametrize("fp16_moments", [False, True])
def test_the_portable_loops_give_the_vector_loops_bits(
    portable_library: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch, fp16_moments: bool
) -> None:
    shapes = [(1029,), (7, 3), (64,), (24,)]  # with tails after 8- and 16-wide vectors
    vectors, vector_step = run(torch.bfloat16, native=True, fp16_moments=fp16_moments,
                               shapes=shapes, factor=0.3)
    monkeypatch.setattr(sharded_adam, "native_library", lambda: portable_library)
    portable, portable_step = run(torch.bfloat16, native=True, fp16_moments=fp16_moments,
                                  shapes=shapes, factor=0.3)
    for a, b in zip(vectors, portable, strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(vector_step.state[a][key], portable_step.state[b][key])


def test_odd_lengths_match_the_torch_step_within_a_rounding() -> None:
    shapes = [(1029,), (7, 3), (5,)]
    ours, _ = run(torch.float16, native=True, shapes=shapes, factor=0.3)
    reference, _ = run(torch.float16, native=False, shapes=shapes, factor=0.3)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=0)  # one fp16 step at most


def test_the_maxima_pass_finds_the_largest_moment_in_every_lane(
    portable_library: ctypes.CDLL
) -> None:
    """A single nonzero gradient at each position of a tensor longer than two vectors: each
    build's maxima pass (16 lanes, 8, or none) reports its moments, wherever it sits."""
    group = native_adam.AdamGroup(beta2=0.98, avg_sq_grad_coefficient=0.02, lerp_weight=0.1,
                                  keep=1.0, grad_divisor=1.0)
    for library in (native_library(), portable_library):
        for position in range(40):
            grad = torch.zeros(40, dtype=torch.bfloat16)
            grad[position] = 1.0
            param = torch.zeros(40, dtype=torch.bfloat16)
            moments = [torch.zeros(40, dtype=torch.float16) for _ in range(2)]
            entry = native_adam.AdamTensor(
                param=param.data_ptr(), grad=grad.data_ptr(), exp_avg=moments[0].data_ptr(),
                exp_avg_sq=moments[1].data_ptr(), numel=40, param_dtype=2, grad_dtype=2,
                moment_dtype=1)
            entry.scale_in[:] = [1.0, 1.0]
            largest = torch.zeros(1, 2)
            assert library.adam_moment_maxima((native_adam.AdamTensor * 1)(entry), 1,
                                              ctypes.byref(group),
                                              ctypes.c_void_p(largest.data_ptr()), 1) == 0
            assert largest.tolist() == [[pytest.approx(0.1), pytest.approx(0.02)]], position
