"""FSDP2's host time per training step at world size 1: per unit, or per parameter?

On a GPU a step whose host work (Python, dispatch, hooks) takes longer than its kernels is
bound by the host, and at NLLB-600M's size on an H200 even stock fairseq may be (issue 28).
This measures, on CPU with arithmetic made negligible (width 32), the host milliseconds of
one forward and backward of 24 transformer-like layers (attention and feed-forward as
separate linears, two layer norms) under ``fully_shard`` at world size 1 (gloo):

- without FSDP (the model's own host time);
- one unit per layer (the plugin's plan), 2 and 4 layers per unit, and one unit for all;
- the same with the linears' biases off (fewer parameters, the same units).

If grouping layers barely helps while fewer parameters do, FSDP2's overhead is per
parameter (its copy-out, DTensor gradients and parameter swaps), which fairscale's flat
parameters avoid, and fewer, larger units are no lever.

    python -m benchmarks.fsdp2_host_overhead      # results/fsdp2_host_overhead.{md,json}
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from launching.harness import free_port, write_results

LAYERS, WIDTH, STEPS, WARMUP = 24, 32, 30, 5


class Layer(nn.Module):
    """Self-attention and feed-forward with pre-norm residuals, linears kept separate."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH, bias=bias) for _ in range(4))
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH, bias=bias), nn.Linear(2 * WIDTH, WIDTH,
                                                                               bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        weights = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2), dim=-1)
        x = x + self.o(weights @ self.v(h))
        return x + self.down(torch.relu(self.up(self.norm2(x))))


def step_milliseconds(layers_per_unit: int | None, bias: bool) -> tuple[float, int]:
    """Median host time of forward + backward after a warm-up, and the parameter count;
    ``layers_per_unit`` None: no FSDP."""
    torch.manual_seed(0)
    layers = [Layer(bias) for _ in range(LAYERS)]
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), *layers)
    if layers_per_unit is not None:
        for start in range(0, LAYERS, layers_per_unit):
            group = layers[start:start + layers_per_unit]
            fully_shard(group if len(group) > 1 else group[0])
        fully_shard(model)
    inputs = torch.randn(8, 16, WIDTH)
    seconds = []
    for _ in range(STEPS):
        start = time.perf_counter()
        model(inputs).sum().backward()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[WARMUP:]) * 1000, len(list(model.parameters()))


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = []
    try:
        for bias in (True, False):
            for per_unit in (None, 1, 2, 4, LAYERS):
                ms, parameters = step_milliseconds(per_unit, bias)
                rows.append({"units": "no FSDP" if per_unit is None else
                             f"{LAYERS // per_unit} ({per_unit} layers each)",
                             "biases": "on" if bias else "off", "parameters": parameters,
                             "host_ms": round(ms, 1)})
    finally:
        dist.destroy_process_group()
    note = (f"Host milliseconds of one forward and backward (median of {STEPS - WARMUP} after "
            f"{WARMUP}), {LAYERS} layers of width {WIDTH}, batch 8 x 16, world size 1 (gloo, "
            "one thread), torch's `fully_shard` with default settings plus a root unit. "
            "Produced by `python -m benchmarks.fsdp2_host_overhead`.")
    print(write_results("fsdp2_host_overhead", rows,
                        [("units", "units"), ("linear biases", "biases"),
                         ("parameters", "parameters"), ("host ms per step", "host_ms")], note))


if __name__ == "__main__":
    main()
