"""Fill fairseq's distributed settings from a torchrun or Slurm launch, so CPU ranks just work.

Stock fairseq defaults ``--distributed-world-size`` to the number of CUDA devices (1 on a
CPU machine, so torchrun silently trains single-process) and computes the device id as
``rank % torch.cuda.device_count()`` (ZeroDivisionError without CUDA).

Ranks started directly by ``srun`` (one task per rank, no torchrun) get torchrun's variables
from Slurm's (:func:`adopt_slurm_environment`), so both launchers take the same path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from fairseq_shard_plugin.errors import ShardingConfigError
from fairseq_shard_plugin.sharding.settings import ranks_per_node

logger = logging.getLogger(__name__)

TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
SLURM_RANK_VARIABLES = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def launched_by_torchrun(environ: os._Environ[str] | dict[str, str] = os.environ) -> bool:
    return all(name in environ for name in TORCHRUN_VARIABLES)


def uses_cuda(cfg: Any) -> bool:
    return torch.cuda.is_available() and not cfg.common.cpu


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: ``gpu[07-09,12],cpu1`` -> ``gpu07``."""
    depth, end = 0, len(nodelist)
    for index, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = index
            break
    first = nodelist[:end]
    while "[" in first:  # keep the first element of every bracket range
        head, rest = first.split("[", 1)
        ranges, tail = rest.split("]", 1)
        first = head + ranges.split(",")[0].split("-")[0] + tail
    return first


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Slurm's ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) read for node ``node_id``."""
    node = 0
    for item in tasks_per_node.split(","):
        count, _, repeat = item.partition("(x")
        node += int(repeat.rstrip(")")) if repeat else 1
        if node_id < node:
            return int(count)
    raise ShardingConfigError(f"Slurm's SLURM_TASKS_PER_NODE={tasks_per_node} has no node "
                              f"{node_id} (SLURM_NODEID): launch with srun inside the job "
                              "allocation, or set the torchrun variables yourself")


def slurm_as_torchrun(
    environ: dict[str, str], port: int, cuda_devices: int = 0
) -> dict[str, str]:
    """torchrun's variables for a rank that ``srun`` started itself (one task per rank).

    Empty when torchrun set them already, when this is no multi-task Slurm step, or when
    there is one task on a node with several GPUs: fairseq's own Slurm mode then spawns a
    process per GPU. ``port`` is the rendezvous port (fairseq's ``--distributed-port``);
    where it is not given (<= 0) one is derived from the job id, the same on every rank.
    """
    if launched_by_torchrun(environ) or not all(v in environ for v in SLURM_RANK_VARIABLES):
        return {}
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if nodelist is None or int(environ["SLURM_NTASKS"]) < 2:
        return {}
    tasks_per_node = (
        environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
        or environ.get("SLURM_NTASKS_PER_NODE") or environ["SLURM_NTASKS"]
    )
    local_ranks = _tasks_on_node(tasks_per_node, int(environ.get("SLURM_NODEID", "0")))
    if local_ranks == 1 and cuda_devices > 1:
        return {}
    if port <= 0:
        port = 20000 + int(environ.get("SLURM_JOB_ID", "0")) % 20000
    return {
        "MASTER_ADDR": first_slurm_host(nodelist),
        "MASTER_PORT": str(port),
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "RANK": environ["SLURM_PROCID"],
        "LOCAL_RANK": environ["SLURM_LOCALID"],
        "LOCAL_WORLD_SIZE": str(local_ranks),
    }


def adopt_slurm_environment(
    cfg: Any, environ: os._Environ[str] | dict[str, str] = os.environ
) -> None:
    """Give a rank started by ``srun`` torchrun's variables (written into ``environ``).

    Sharded runs only: other runs keep fairseq's own Slurm initialisation.
    """
    dist_cfg = cfg.distributed_training
    if dist_cfg.ddp_backend != "fully_sharded" or dist_cfg.distributed_init_method is not None:
        return
    cuda_devices = torch.cuda.device_count() if uses_cuda(cfg) else 0
    port = cfg.distributed_training.distributed_port
    environ.update(slurm_as_torchrun(dict(environ), port, cuda_devices))


def host_threads_per_rank(environ: Mapping[str, str] = os.environ,
                          cores: int | None = None) -> int:
    """CPU threads each rank of this node may use: the cores this process may run on,
    shared by the node's ranks (as the launcher says: :func:`.ranks_per_node`)."""
    available = cores or len(os.sched_getaffinity(0))
    return max(1, available // (ranks_per_node(environ) or 1))


# CUDA's caching allocator grows segments in place instead of keeping freed blocks of
# fixed-size segments: FSDP's gathers and frees of differently sized units otherwise leave
# reserved memory far above the allocated peak (38 against 22 GiB in the first GPU run)
ALLOCATOR_SETTING = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def default_allocator_setting(environ: os._Environ[str] | dict[str, str] = os.environ,
                              use_cuda: bool = True) -> str | None:
    """Set :data:`ALLOCATOR_SETTING` for a sharded CUDA run unless the user configured the
    allocator (or CUDA is initialised already, when it would no longer apply); return what
    was set, for the log."""
    name, value = ALLOCATOR_SETTING
    if not use_cuda or name in environ or "PYTORCH_ALLOC_CONF" in environ:
        return None
    if torch.cuda.is_initialized():
        return None
    environ[name] = value
    return f"{name}={value}"


def apply_torchrun_environment(
    cfg: Any, environ: os._Environ[str] | dict[str, str] = os.environ
) -> None:
    """Take world size, rank and device from torchrun's variables (or Slurm's); gloo on CPU."""
    dist_cfg = cfg.distributed_training
    adopt_slurm_environment(cfg, environ)
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
        if dist_cfg.distributed_backend != "gloo" and dist_cfg.distributed_rank == 0:
            logger.info("CPU ranks: using the gloo backend instead of %s",
                        dist_cfg.distributed_backend)
        dist_cfg.distributed_backend = "gloo"


def ensure_process_group(cfg: Any, use_cuda: bool) -> None:
    """FSDP needs a process group even where fairseq did not make one.

    ``fairseq-hydra-train`` imports the user dir only after it has chosen how to launch, so
    without the plugin's Hydra callback (``hydra_callback``) it runs every rank under
    torchrun as a lone process: such a rank joins the others here,
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
