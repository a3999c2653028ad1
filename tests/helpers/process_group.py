"""Ending a helper's process group."""

from __future__ import annotations

import torch.distributed as dist


def leave_process_group() -> None:
    """Tear the group down together. Under load, a rank once aborted at exit ("terminate
    called without an active exception") when it tore down its gloo group while another
    rank was still in the last collective."""
    dist.barrier()
    dist.destroy_process_group()
