"""One Adam step on the host over one rank's shards of NLLB-600M: which implementation.

Under ``--cpu-offload`` the optimizer steps on the CPU over every parameter of the rank's
shards, once per update. This measures, on the same shards (the parameter shapes of
``nllb_dense_600m`` split over ``--world-size`` ranks along dim 0, as FSDP2 shards them),
the same gradients and the same existing Adam state:

- fairseq's Adam (``fairseq.optim.adam.Adam``: one tensor at a time, about ten operators);
- torch's Adam with ``foreach=True`` and ``fused=True`` (``torch.optim.AdamW``);
- the plugin's Adam (``sharding/sharded_adam.py``: torch's fused kernel in pieces, with
  fairseq's epsilon), with fp32 and with 16-bit moments, and over 16-bit parameters.

Each is timed over the fastest of three steps after the first (which creates the state),
and its result is compared with fairseq's (the largest parameter difference, next to the
largest update). NLLB's epsilon (1e-6) is large next to small gradients, so where it enters
matters: torch's AdamW adds it after the bias correction, fairseq before.

    python -m benchmarks.host_adam                # 2 ranks' shards, this host's threads
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable

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


IMPLEMENTATIONS: dict[str, tuple[Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                                 torch.dtype]] = {
    "fairseq Adam (fp32)": (fairseq_adam, torch.float32),
    "torch AdamW foreach (fp32)": (torch_adamw(foreach=True), torch.float32),
    "torch AdamW fused (fp32)": (torch_adamw(fused=True), torch.float32),
    "plugin ShardedAdam (fp32)": (sharded_adam(), torch.float32),
    "plugin ShardedAdam, fp16 moments": (sharded_adam(fp16_moments=True), torch.float32),
    "plugin ShardedAdam, 16-bit params + fp16 moments": (
        sharded_adam(fp16_moments=True), torch.bfloat16),
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
    return {"implementation": name, "elements": elements, "first_step_s": seconds[0],
            "step_s": min(seconds[1:])}, result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    options = parser.parse_args(argv)
    torch.set_num_threads(options.threads)
    shapes = shard_shapes(nllb_600m_shapes(), options.world_size)
    start = make_tensors(shapes, 0, 0.02)
    rows, reference = [], None
    for name in IMPLEMENTATIONS:
        row, result = measure(name, shapes)
        if reference is None:
            reference = [r - s for r, s in zip(result, start, strict=True)]  # the update
            reference_result = result
        row["difference_vs_fairseq"] = max(
            float((r - f).abs().max()) for r, f in zip(result, reference_result, strict=True))
        row["largest_update"] = max(float(u.abs().max()) for u in reference)
        row["speedup_vs_fairseq"] = rows[0]["step_s"] / row["step_s"] if rows else 1.0
        print(json.dumps(row), flush=True)
        rows.append(row)
        del result
        gc.collect()
    note = (f"One Adam step over rank 0's shards of nllb_dense_600m at world size "
            f"{options.world_size} ({rows[0]['elements'] / 1e6:.0f}M elements), "
            f"{options.threads} threads, on this host's CPU; step: one step with "
            "Adam's state existing (fastest of 3); difference: the largest parameter "
            f"difference from fairseq's Adam after {1 + TIMED_STEPS} steps (the "
            "16-bit-parameter row includes bf16 "
            "rounding of the parameters). Produced by `python -m benchmarks.host_adam "
            f"--world-size {options.world_size} --threads {options.threads}`.")
    columns = [("implementation", "implementation"), ("step (s)", "step_s"),
               ("speed-up vs fairseq", "speedup_vs_fairseq"),
               ("difference vs fairseq", "difference_vs_fairseq"),
               ("largest update", "largest_update")]
    table = write_results("host_adam", [_rounded(row) for row in rows], columns, note)
    print(table)


def _rounded(row: dict) -> dict:
    return {**row, "first_step_s": round(row["first_step_s"], 2),
            "step_s": round(row["step_s"], 2),
            "speedup_vs_fairseq": round(row["speedup_vs_fairseq"], 2),
            "difference_vs_fairseq": float(f"{row['difference_vs_fairseq']:.2e}"),
            "largest_update": float(f"{row['largest_update']:.2e}")}


if __name__ == "__main__":
    main()
