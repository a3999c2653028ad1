"""Let fairscale FSDP run forward and backward on CPU gloo ranks, for tests only.

fairscale calls CUDA stream APIs unconditionally in forward and backward (stream
switches, ``wait_stream``, ``record_stream``); on a CPU there is one stream and all of
them are no-ops, which is what this stands in for. Its bucketed reduce-scatter passes a
(world, n) tensor that NCCL takes as flat and gloo refuses; it is flattened here. Nothing
of the plugin is replaced: the engine, the wrap plan and fairscale's sharding, gathering,
gradient reduction and mixed precision all run for real. Not a substitute for a GPU run.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist


class _CpuStream:
    """The one CPU stream: every stream compares equal and waiting is a no-op."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CpuStream)

    __hash__ = object.__hash__


def emulate_cuda_streams_on_cpu() -> None:
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    stream = _CpuStream()
    torch.cuda.current_stream = lambda *args, **kwargs: stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.record_stream = lambda self, s: None

    reduce_scatter = dist._reduce_scatter_base

    def flat_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Any = None,
                            async_op: bool = False) -> Any:
        return reduce_scatter(output.view(-1), input.reshape(-1), group=group,
                              async_op=async_op)

    dist._reduce_scatter_base = flat_reduce_scatter

    setup_streams = FullyShardedDataParallel._setup_streams

    def setup_cpu_streams(self: FullyShardedDataParallel) -> None:
        available = torch.cuda.is_available
        torch.cuda.is_available, torch.cuda.Stream = (lambda: True), _CpuStream
        try:
            setup_streams(self)  # creates the reducer and shares it with inner units
        finally:
            torch.cuda.is_available = available

    FullyShardedDataParallel._setup_streams = setup_cpu_streams
