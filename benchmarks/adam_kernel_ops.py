"""Operations one step of the plugin's torch Adam route dispatches: a CPU count of GPU work.

On GPUs the plugin's Adam (``sharding/sharded_adam.py``) runs its torch route: each aten
operation that computes is at least one kernel launch, and each value read back from a
tensor (``aten._local_scalar_dense``) waits for every queued kernel. This counts both over
one step (the second: the first creates the state) on rank 0's shards of nllb_dense_600m
at world size 512, small enough to be quick on CPU and all in one chunk of the step, with
fp32 state and with the NLLB configs' 16-bit state (bf16 parameters, scaled fp16 moments).
Operations that only make views or allocate are not counted.

``--code REV`` counts the same with ``sharded_adam.py`` as it was at git revision REV.

    python -m benchmarks.adam_kernel_ops                   # results/adam_kernel_ops.{md,json}
    python -m benchmarks.adam_kernel_ops --code 601dfc1    # the route before it was batched
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.host_adam import nllb_600m_shapes, shard_shapes
from launching.harness import REPO, write_results

WORLD_SIZE = 512
NO_KERNEL = {"aten.view.default", "aten.slice.Tensor", "aten.empty_like.default",
             "aten.select.int", "aten.unbind.int", "aten.detach.default"}


class Counting(TorchDispatchMode):
    """Computing operations and read-backs dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        name = str(func)
        self.kernels += name not in NO_KERNEL and not name.startswith("profiler")
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def sharded_adam_module(revision: str | None) -> ModuleType:
    """``sharding/sharded_adam.py`` of this checkout, or as it was at ``revision``."""
    if revision is None:
        from fairseq_shard_plugin.sharding import sharded_adam

        return sharded_adam
    source = subprocess.run(["git", "show", f"{revision}:fairseq_shard_plugin/sharding/"
                             "sharded_adam.py"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout
    path = Path(tempfile.mkdtemp()) / "sharded_adam_at_revision.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def count(module: ModuleType, dtype: torch.dtype, fp16_moments: bool) -> Counting:
    shapes = shard_shapes(nllb_600m_shapes(), WORLD_SIZE)
    params = [torch.randn(shape).to(dtype).requires_grad_() for shape in shapes]
    optimizer = module.ShardedAdam(params, lr=1e-3, fp16_moments=fp16_moments, native=False)
    for _ in range(2):
        for param in params:
            param.grad = torch.randn(param.shape).to(dtype)
        counting = Counting()
        with counting:
            optimizer.step(grad_factor=1 / 3)
    return counting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--code", help="git revision of sharded_adam.py (default: this one)")
    args = parser.parse_args()
    module = sharded_adam_module(args.code)
    code = args.code or "this checkout"
    rows = []
    for state, dtype, fp16_moments in (("fp32", torch.float32, False),
                                       ("bf16 parameters, fp16 moments", torch.bfloat16, True)):
        counting = count(module, dtype, fp16_moments)
        rows.append({"code": code, "state": state,
                     "tensors": len(shard_shapes(nllb_600m_shapes(), WORLD_SIZE)),
                     "kernels": counting.kernels, "reads": counting.reads})
    suffix = f"_{args.code}" if args.code else ""
    command = "python -m benchmarks.adam_kernel_ops" + (f" --code {args.code}" if args.code
                                                        else "")
    print(write_results(
        f"adam_kernel_ops{suffix}", rows,
        [("code", "code"), ("state", "state"), ("tensors", "tensors"),
         ("computing operations per step", "kernels"), ("values read back", "reads")],
        f"One step of the torch route (`native=False`, as on GPUs) over rank 0's shards of "
        f"nllb_dense_600m at world size {WORLD_SIZE}, counted on CPU by a dispatch mode. "
        f"Produced by `{command}`."))


if __name__ == "__main__":
    main()
