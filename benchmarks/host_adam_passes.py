"""What bounds each pass of the C host Adam step: arithmetic or memory.

``sharding/native_adam.c`` steps 16-bit state in two passes (the new moments' maxima, then
the update) and fp32 state in the update pass alone. This times each pass, on one thread,
over one tensor that stays in this core's L2 cache (32,768 elements, repeated) and over one
that streams from memory (50M elements): where both give the same time the pass is bound
by its arithmetic (the update: a square root and two divisions per element, torch's
arithmetic kept bit for bit), where the large tensor is slower, by memory. ``--code REV``
times ``native_adam.c`` as it was at git revision REV, built with the same flags;
``--without-divisions`` times this source with the vector update's square root and two
divisions replaced by multiplications (wrong results, for the time memory alone takes).

    python -m benchmarks.host_adam_passes      # writes results/host_adam_passes.{md,json}
    python -m benchmarks.host_adam_passes --code 1f0b871   # 8 elements at a time, no prefetch
    python -m benchmarks.host_adam_passes --without-divisions
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from fairseq_shard_plugin.sharding.native_adam import (
    DTYPE_CODES,
    FLAGS,
    SOURCE,
    AdamGroup,
    AdamTensor,
    native_library,
)
from launching.harness import REPO, write_results

SIZES = {"in L2 (32,768)": (32768, 3000), "from memory (50M)": (50_000_000, 3)}  # repeats
STATES = {"fp32 state": (torch.float32, torch.float32),
          "bf16 parameters, fp16 moments": (torch.bfloat16, torch.float16)}


def tensor_entry(numel: int, param_dtype: torch.dtype, moment_dtype: torch.dtype
                 ) -> tuple[AdamTensor, list[torch.Tensor]]:
    """One tensor's C entry with NLLB-like values (and the tensors it points into)."""
    generator = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(numel, generator=generator) * scale).to(dtype) for scale, dtype in (
        (0.02, param_dtype), (1e-3, param_dtype), (1e-4, moment_dtype))]
    tensors.append((torch.rand(numel, generator=generator) * 1e-6).to(moment_dtype))
    entry = AdamTensor()
    entry.param, entry.grad, entry.exp_avg, entry.exp_avg_sq = (t.data_ptr() for t in tensors)
    entry.numel = numel
    entry.param_dtype = entry.grad_dtype = DTYPE_CODES[param_dtype]
    entry.moment_dtype = DTYPE_CODES[moment_dtype]
    scale = 1e-4 if moment_dtype == torch.float16 else 1.0  # stored x scale = moment
    entry.scale_in[:] = entry.scale_out[:] = [scale, scale]
    entry.step_size, entry.bias_correction2_sqrt = 1e-4, 0.3
    entry.eps = 1e-6 / 0.3
    return entry, tensors


def pass_ns(library: ctypes.CDLL, numel: int, repeats: int, param_dtype: torch.dtype,
            moment_dtype: torch.dtype) -> dict[str, float]:
    """ns per element of each pass, the fastest of three rounds of ``repeats`` calls."""
    entry, _tensors = tensor_entry(numel, param_dtype, moment_dtype)
    array = (AdamTensor * 1)(entry)
    group = AdamGroup(beta2=0.98, avg_sq_grad_coefficient=0.02, lerp_weight=0.1, keep=1.0,
                      grad_divisor=1.0)
    largest = (ctypes.c_float * 2)()
    calls = {"maxima": lambda: library.adam_moment_maxima(array, 1, ctypes.byref(group),
                                                          largest, 1),
             "update": lambda: library.adam_update(array, 1, ctypes.byref(group), 1)}
    fastest = {}
    for name, call in calls.items():
        rounds = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(repeats):
                call()
            rounds.append((time.perf_counter() - start) / repeats / numel * 1e9)
        fastest[name] = min(rounds)
    return fastest


# the vector update's arithmetic, and the same with multiplications only (--without-divisions)
DIVIDING = ("        denom = v_add(v_div(v_sqrt(new_avg_sq), correction), eps);\n"
            "        p = v_add(p, v_div(v_mul(step_down, new_avg), denom));\n")
MULTIPLYING = ("        denom = v_add(v_mul(new_avg_sq, correction), eps);\n"
               "        p = v_add(p, v_mul(v_mul(step_down, new_avg), denom));\n")


def library_at(revision: str | None, directory: Path, divisions: bool = True) -> ctypes.CDLL:
    """``native_adam.c`` as it was at git ``revision`` (None: as it is here), optionally
    without the update's divisions, built with this checkout's flags."""
    source = directory / "native_adam.c"
    path = SOURCE.relative_to(REPO).as_posix()
    text = (SOURCE.read_text() if revision is None else subprocess.run(
        ["git", "show", f"{revision}:{path}"], cwd=REPO, capture_output=True, check=True,
        text=True).stdout)
    if not divisions:
        if DIVIDING not in text:
            raise SystemExit("the vector update's arithmetic is not where it was expected")
        text = text.replace(DIVIDING, MULTIPLYING)
    source.write_text(text)
    built = directory / "native_adam.so"
    subprocess.run(["cc", *FLAGS, "-o", str(built), str(source)], check=True)
    return ctypes.CDLL(str(built))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", help="git revision of native_adam.c (default: this one)")
    parser.add_argument("--without-divisions", action="store_true",
                        help="the update's square root and divisions made multiplications")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        if args.code or args.without_divisions:
            library = library_at(args.code, Path(directory), not args.without_divisions)
        else:
            library = native_library()
        if library is None:
            raise SystemExit("no C step here (no compiler, or "
                             "FAIRSEQ_SHARD_PLUGIN_NATIVE_ADAM=0)")
        code = (args.code or "this checkout") + (
            ", without divisions" if args.without_divisions else "")
        suffix = ("_" + args.code if args.code else "") + (
            "_without_divisions" if args.without_divisions else "")
        command = "python -m benchmarks.host_adam_passes" + "".join(
            f" {flag}" for flag in ([f"--code {args.code}"] if args.code else [])
            + (["--without-divisions"] if args.without_divisions else []))
        measure_all(library, code, suffix, command)


def measure_all(library: ctypes.CDLL, code: str, suffix: str, command: str) -> None:
    rows = []
    for state, dtypes in STATES.items():
        for where, (numel, repeats) in SIZES.items():
            ns = pass_ns(library, numel, repeats, *dtypes)
            maxima = ns["maxima"] if dtypes[1] == torch.float16 else None  # fp32: no pass
            rows.append({"code": code, "state": state, "tensor": where,
                         "maxima_ns": None if maxima is None else round(maxima, 3),
                         "update_ns": round(ns["update"], 3),
                         "step_ns": round(ns["update"] + (maxima or 0.0), 3)})
            print(rows[-1], flush=True)
    columns = [("code", "code"), ("state", "state"), ("tensor", "tensor"),
               ("maxima pass (ns/element)", "maxima_ns"),
               ("update pass (ns/element)", "update_ns"), ("step (ns/element)", "step_ns")]
    note = ("One thread, one tensor, this host's CPU and the C step as built here (-march="
            "native); fastest of 3 rounds. fp32 state has no maxima pass. Produced by "
            f"`{command}`.")
    print(write_results("host_adam_passes" + suffix, rows, columns, note))


if __name__ == "__main__":
    main()
