"""Fill fairseq's distributed settings from a torchrun launch, so CPU ranks just work.

Stock fairseq defaults ``--distributed-world-size`` to the number of CUDA devices (1 on a
CPU machine, so torchrun silently trains single-process) and computes the device id as
``rank % torch.cuda.device_count()`` (ZeroDivisionError without CUDA).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def launched_by_torchrun(environ: os._Environ[str] | dict[str, str] = os.environ) -> bool:
    return all(name in environ for name in TORCHRUN_VARIABLES)


def uses_cuda(cfg: Any) -> bool:
    return torch.cuda.is_available() and not cfg.common.cpu


def apply_torchrun_environment(
    cfg: Any, environ: os._Environ[str] | dict[str, str] = os.environ
) -> None:
    """Take world size, rank and device from torchrun's variables; gloo on CPU."""
    dist_cfg = cfg.distributed_training
    if dist_cfg.distributed_init_method is not None or not launched_by_torchrun(environ):
        return
    dist_cfg.distributed_init_method = "env://"
    dist_cfg.distributed_world_size = int(environ["WORLD_SIZE"])
    dist_cfg.distributed_rank = int(environ["RANK"])
    dist_cfg.distributed_no_spawn = True
    if uses_cuda(cfg):
        dist_cfg.device_id = int(environ.get("LOCAL_RANK", 0))
    else:
        dist_cfg.device_id = 0
        if dist_cfg.distributed_backend != "gloo":
            logger.info("CPU ranks: using the gloo backend instead of %s",
                        dist_cfg.distributed_backend)
            dist_cfg.distributed_backend = "gloo"


def ensure_process_group(cfg: Any, use_cuda: bool) -> None:
    """FSDP needs a process group even where fairseq did not make one.

    ``fairseq-hydra-train`` imports the user dir only after it has chosen how to launch, so
    under torchrun it runs every rank as a lone process: such a rank joins the others here,
    from torchrun's environment. A single process without torchrun gets a 1-rank group.
    """
    if dist.is_initialized():
        return
    backend = "nccl" if use_cuda else "gloo"
    if not launched_by_torchrun():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, init_method="env://")
    cfg.distributed_training.distributed_world_size = dist.get_world_size()
    cfg.distributed_training.distributed_rank = dist.get_rank()
    if dist.get_rank() != 0:
        logging.getLogger().setLevel(logging.WARNING)  # as fairseq's own distributed init does
