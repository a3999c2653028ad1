"""What a GPU configuration costs on CPU ranks, said once at start.

The one-GPU recipe (``configs/nllb/hardware/one_24gb_gpu.yaml``) on a CPU machine ran about
ten times slower than ``tiny.yaml`` without a word (T1 #5, session 25): its offload copies
state that already lives on the host, and fp16 arithmetic on most CPUs is far slower than
fp32 or bf16.
"""

from __future__ import annotations

import torch

from fairseq_shard_plugin.sharding.settings import ShardingSettings


def cpu_rank_hints(settings: ShardingSettings, use_cuda: bool) -> list[str]:
    """The warnings for a run on CPU ranks with settings meant for GPUs; none on GPUs."""
    if use_cuda:
        return []
    hints = []
    if settings.offload:
        hints.append("--cpu-offload on CPU ranks: the model state lives on the host already, "
                     "so the offload only adds copies (it is for GPUs; drop it here)")
    if settings.compute_dtype == torch.float16:
        hints.append("fp16 compute on CPU ranks: most CPUs run fp16 far slower than fp32 or "
                     "bf16 (use --bf16 or --memory-efficient-bf16 here)")
    return hints
