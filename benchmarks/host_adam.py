"""One Adam step on the host over one rank's shards of NLLB-600M: which implementation.

Under ``--cpu-offload`` the optimizer steps on the CPU over every parameter of the rank's
shards, once per update. This measures, on the same shards (the parameter shapes of
``nllb_dense_600m`` split over ``--world-size`` ranks along dim 0, as FSDP2 shards them),
the same gradients and the same existing Adam state, at each of ``--threads``:

- fairseq's Adam (``fairseq.optim.adam.Adam``: one tensor at a time, about ten operators);
- torch's AdamW with ``foreach=True`` and ``fused=True``; DeepSpeed's ``DeepSpeedCPUAdam``
  when ``deepspeed`` is importable (its JIT build is not timed);
- the plugin's Adam (``sharding/sharded_adam.py``) with fp32 and with 16-bit state, each in
  its two ways: the C step (``sharding/native_adam.c``) and the
  pure-torch step it falls back to without a compiler;
- ``torch.compile`` of the same 16-bit step (inductor's C++ on CPU; compile time apart).

Each is timed over the fastest of three steps after the first (which creates the state),
and its result is compared with fairseq's (the largest parameter difference, next to the
largest update). NLLB's epsilon (1e-6) is large next to small gradients, so where it enters
matters: torch's AdamW adds it after the bias correction, fairseq before.

    python -m benchmarks.host_adam                 # world size 8's shard, 1 and 2 threads
    python -m benchmarks.host_adam --world-size 2 --threads 2
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from launching.harness import write_results

VOCABULARY, DIM, FFN, LAYERS = 256206, 1024, 4096, 12
SETTINGS = dict(lr=1e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.0)  # NLLB's
TIMED_STEPS = 3  # after the first (which creates the state); the fastest is reported


def nllb_600m_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of nllb_dense_600m (shared embeddings, pre-norm layers)."""
    attention = [(DIM, DIM), (DIM,)] * 4
    norm = [(DIM,), (DIM,)]
    ffn = [(FFN, DIM), (FFN,), (DIM, FFN), (DIM,)]
    encoder = (attention + ffn + norm * 2) * LAYERS
    decoder = (attention * 2 + ffn + norm * 3) * LAYERS
    return [(VOCABULARY, DIM), *encoder, *norm, *decoder, *norm]


def shard_shapes(shapes: list[tuple[int, ...]], ranks: int) -> list[tuple[int, ...]]:
    """Rank 0's shard of each shape: dim 0 split in ``ranks`` (rounded up), as FSDP2."""
    return [(-(-shape[0] // ranks), *shape[1:]) for shape in shapes]


def make_tensors(shapes: list[tuple[int, ...]], seed: int, scale: float,
                 dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator) * scale).to(dtype) for shape in shapes]


def fairseq_adam(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    from fairseq.optim.adam import Adam

    return Adam(params, **SETTINGS)


def torch_adamw(**kind: bool) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    return lambda params: torch.optim.AdamW(params, **SETTINGS, **kind)


def sharded_adam(**options: bool) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    from fairseq_shard_plugin.sharding.sharded_adam import ShardedAdam

    return lambda params: ShardedAdam(params, **SETTINGS, **options)


def deepspeed_cpu_adam(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, **SETTINGS, adamw_mode=True)


class CompiledAdam16:
    """The plugin's 16-bit step (scaled fp16 moments) as two ``torch.compile``d functions
    per tensor: the new moments' maxima, then the update, both in fp32 math."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params, self.step_count = params, 0
        self.moments = [[torch.zeros_like(p, dtype=torch.float16) for _ in range(2)]
                        for p in params]
        self.scales = [torch.ones(2) for _ in params]
        self.maxima = torch.compile(_new_moment_maxima, dynamic=True)
        self.update = torch.compile(_compiled_update, dynamic=True)

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        beta1, beta2 = SETTINGS["betas"]
        constants = torch.tensor([beta1, beta2, SETTINGS["lr"] / (1 - beta1**self.step_count),
                                  SETTINGS["eps"] / (1 - beta2**self.step_count) ** 0.5,
                                  (1 - beta2**self.step_count) ** 0.5])
        for param, (avg, avg_sq), scales in zip(self.params, self.moments, self.scales,
                                                strict=True):
            if not param.numel():
                continue
            new_scales = 1e-8 + self.maxima(param.grad, avg, avg_sq, scales, constants) / 65504
            self.update(param, param.grad, avg, avg_sq, scales, new_scales, constants)
            scales.copy_(new_scales)


def _new_moments(grad: torch.Tensor, avg: torch.Tensor, avg_sq: torch.Tensor,
                 scales: torch.Tensor, constants: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    g = grad.float()
    beta1, beta2 = constants[0], constants[1]
    return (avg.float() * scales[0] * beta1 + (1 - beta1) * g,
            avg_sq.float() * scales[1] * beta2 + (1 - beta2) * g * g)


def _new_moment_maxima(grad: torch.Tensor, avg: torch.Tensor, avg_sq: torch.Tensor,
                       scales: torch.Tensor, constants: torch.Tensor) -> torch.Tensor:
    first, second = _new_moments(grad, avg, avg_sq, scales, constants)
    return torch.stack([first.abs().amax(), second.amax()])


def _compiled_update(param: torch.Tensor, grad: torch.Tensor, avg: torch.Tensor,
                     avg_sq: torch.Tensor, scales: torch.Tensor, new_scales: torch.Tensor,
                     constants: torch.Tensor) -> None:
    first, second = _new_moments(grad, avg, avg_sq, scales, constants)
    step_size, eps, correction = constants[2], constants[3], constants[4]
    param.copy_(param.float() - step_size * first / (second.sqrt() / correction + eps))
    avg.copy_(first / new_scales[0])
    avg_sq.copy_(second / new_scales[1])


# name: (optimizer factory, parameter dtype); 16-bit rows say which step runs them
IMPLEMENTATIONS: dict[str, tuple[Callable[[list[torch.Tensor]], Any], torch.dtype]] = {
    "fairseq Adam (fp32)": (fairseq_adam, torch.float32),
    "torch AdamW foreach (fp32)": (torch_adamw(foreach=True), torch.float32),
    "torch AdamW fused (fp32)": (torch_adamw(fused=True), torch.float32),
    "DeepSpeed CPUAdam (fp32)": (deepspeed_cpu_adam, torch.float32),
    "plugin ShardedAdam (fp32)": (sharded_adam(), torch.float32),
    "plugin, fp32, torch step": (sharded_adam(native=False), torch.float32),
    "plugin, fp16 moments, torch step": (
        sharded_adam(fp16_moments=True, native=False), torch.float32),
    "plugin, fp16 moments, C step": (sharded_adam(fp16_moments=True), torch.float32),
    "plugin, bf16 params + fp32 moments, C step": (sharded_adam(), torch.bfloat16),
    "plugin, bf16 params + fp16 moments, torch step": (
        sharded_adam(fp16_moments=True, native=False), torch.bfloat16),
    "plugin, bf16 params + fp16 moments, C step": (
        sharded_adam(fp16_moments=True), torch.bfloat16),
    "torch.compile, bf16 params + fp16 moments": (CompiledAdam16, torch.bfloat16),
}


def measure(name: str, shapes: list[tuple[int, ...]]) -> tuple[dict, list[torch.Tensor]]:
    make, dtype = IMPLEMENTATIONS[name]
    params = [p.requires_grad_() for p in make_tensors(shapes, 0, 0.02, dtype)]
    optimizer = make(params)
    seconds = []
    for step in range(1 + TIMED_STEPS):
        for param, grad in zip(params, make_tensors(shapes, step + 1, 1e-3, dtype),
                               strict=True):
            param.grad = grad
        start = time.perf_counter()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
        for param in params:
            param.grad = None
    result = [p.detach().float() for p in params]
    del optimizer, params
    gc.collect()
    elements = sum(torch.Size(s).numel() for s in shapes)
    step = min(seconds[1:])
    return {"implementation": name, "threads": torch.get_num_threads(), "elements": elements,
            "first_step_s": seconds[0], "step_s": step,
            "ns_per_element": step / elements * 1e9}, result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--threads", default="1,2",
                        help="comma-separated thread counts (default: 1,2)")
    parser.add_argument("--only", nargs="*", help="these implementations (and fairseq's)")
    options = parser.parse_args(argv)
    shapes = shard_shapes(nllb_600m_shapes(), options.world_size)
    start = make_tensors(shapes, 0, 0.02)
    names = [name for name in IMPLEMENTATIONS if _available(name)
             and (not options.only or name in options.only or name.startswith("fairseq"))]
    rows, reference, reference_result = [], None, None
    for threads in [int(count) for count in options.threads.split(",")]:
        torch.set_num_threads(threads)
        same_threads: dict[str, dict] = {}
        for name in names:
            row, result = measure(name, shapes)
            if reference is None:
                reference = [r - s for r, s in zip(result, start, strict=True)]  # the update
                reference_result = result
            row["difference_vs_fairseq"] = max(
                float((r - f).abs().max())
                for r, f in zip(result, reference_result, strict=True))
            row["largest_update"] = max(float(u.abs().max()) for u in reference)
            same_threads[name] = row
            for key, baseline in (("vs_plugin_fp32", "plugin ShardedAdam (fp32)"),
                                  ("vs_deepspeed_fp32", "DeepSpeed CPUAdam (fp32)")):
                row[key] = (same_threads[baseline]["step_s"] / row["step_s"]
                            if baseline in same_threads else None)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del result
            gc.collect()
    command = "python -m benchmarks.host_adam --world-size {} --threads {}{}".format(
        options.world_size, options.threads,
        "".join(f" --only {name!r}" for name in options.only or []))
    note = (f"One Adam step over rank 0's shards of nllb_dense_600m at world size "
            f"{options.world_size} ({rows[0]['elements'] / 1e6:.0f}M elements), on this "
            "host's CPU; step: one step with Adam's state existing (fastest of 3), in ns per "
            "element; speed-ups: the same thread count's plugin fp32 step and DeepSpeed's "
            "CPUAdam (n/a: not measured for that row, or deepspeed not installed); first "
            "step: creates the state (and "
            "compiles, for torch.compile); difference: the largest parameter difference "
            f"from fairseq's Adam after {1 + TIMED_STEPS} steps (bf16 rows include bf16 "
            f"rounding of the parameters). Produced by `{command}`.")
    columns = [("implementation", "implementation"), ("threads", "threads"),
               ("step (s)", "step_s"), ("ns per element", "ns_per_element"),
               ("vs plugin fp32", "vs_plugin_fp32"), ("vs DeepSpeed fp32", "vs_deepspeed_fp32"),
               ("first step (s)", "first_step_s"),
               ("difference vs fairseq", "difference_vs_fairseq")]
    table = write_results("host_adam", [_rounded(row) for row in rows], columns, note)
    print(table)


def _available(name: str) -> bool:
    if name.startswith("DeepSpeed"):
        return importlib.util.find_spec("deepspeed") is not None
    return True


def _rounded(row: dict) -> dict:
    def ratio(value: float | None) -> float | None:
        return None if value is None else round(value, 2)
    return {**row, "first_step_s": round(row["first_step_s"], 2),
            "step_s": round(row["step_s"], 3), "ns_per_element": round(row["ns_per_element"], 2),
            "vs_plugin_fp32": ratio(row["vs_plugin_fp32"]),
            "vs_deepspeed_fp32": ratio(row["vs_deepspeed_fp32"]),
            "difference_vs_fairseq": float(f"{row['difference_vs_fairseq']:.2e}"),
            "largest_update": float(f"{row['largest_update']:.2e}")}


if __name__ == "__main__":
    main()
