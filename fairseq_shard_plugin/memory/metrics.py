"""Log a step's peak memory, max over ranks, as fairseq metrics on every log line."""

from __future__ import annotations

import torch
import torch.distributed as dist
from fairseq.logging import metrics
from fairseq.logging.meters import Meter, safe_round

from fairseq_shard_plugin.memory.meters import StepMemory
from fairseq_shard_plugin.memory.model import GIB

PEAK_KEY = "peak_mem_gb"  # CUDA max allocated, or peak live tensor bytes on CPU
RESERVED_KEY = "peak_reserved_gb"  # CUDA only: the caching allocator's peak
STATE_KEY = "state_mem_gb"  # parameters + gradients + optimizer state held by a rank
# with --cpu-offload only: the accelerator-side peak (CUDA: as PEAK_KEY; CPU: the peak of
# live tensor bytes without the offloaded state, see memory.LiveTensorMeter)
DEVICE_KEY = "device_mem_gb"


class MaxMeter(Meter):
    """The largest value logged in the aggregation window (a log interval, an epoch)."""

    def __init__(self, round: int | None = 4) -> None:
        self.round = round
        self.max: float | None = None

    def reset(self) -> None:
        self.max = None

    def update(self, value: float) -> None:
        self.max = value if self.max is None else max(self.max, value)

    def state_dict(self) -> dict:
        return {"max": self.max, "round": self.round}

    def load_state_dict(self, state_dict: dict) -> None:
        self.max, self.round = state_dict["max"], state_dict.get("round")

    @property
    def smoothed_value(self) -> float | None:
        return safe_round(self.max, self.round) if self.max is not None else None


def _log_max(key: str, value_gb: float, priority: int) -> None:
    metrics.log_custom(MaxMeter, key, value_gb, priority=priority)


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over the ranks (one all-reduce on ``device``); on one rank the
    values themselves, without a round trip through the device (two waits on a GPU)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def log_step_memory(
    step: StepMemory | None, state_bytes: int, device: torch.device, offloaded: bool = False
) -> None:
    """All-reduce the rank's figures (MAX) and log them; every rank must call this.

    ``step`` is None on a rank that could not measure the step (a torch profiler of the
    user's was running); the others' figures are logged, or none if no rank measured.
    ``offloaded`` (``--cpu-offload``) adds the accelerator-side peak.
    """
    if step is None:
        values = [-1.0, -1.0, float(state_bytes), -1.0]
    else:
        on_device = step.peak_device if step.peak_device is not None else step.peak_allocated
        reserved = step.peak_reserved if step.peak_reserved is not None else 0
        values = [step.peak_allocated, reserved, state_bytes, on_device]
    peak, reserved, state, on_device = max_over_ranks(values, device)
    _log_max(STATE_KEY, state / GIB, priority=902)
    if peak < 0:
        return
    _log_max(PEAK_KEY, peak / GIB, priority=900)
    if device.type == "cuda":
        _log_max(RESERVED_KEY, reserved / GIB, priority=901)
    if offloaded:
        _log_max(DEVICE_KEY, on_device / GIB, priority=903)
