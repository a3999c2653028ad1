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
import re
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


_WHAT_TO_DO = "launch with srun inside the job allocation, or set the torchrun variables yourself"
_RANGE = r"[0-9]+(?:-[0-9]+)?"
# one host or bracketed range of hosts of a Slurm hostlist: ``gpu[07-09,12]``, ``rack[2-3]-n1``
_HOSTLIST_ELEMENT = re.compile(rf"(?:[^\[\],]+|\[{_RANGE}(?:,{_RANGE})*\])+")


def first_slurm_host(nodelist: str, variable: str = "SLURM_JOB_NODELIST") -> str:
    """The first host of a Slurm hostlist: ``gpu[07-09,12],cpu1`` -> ``gpu07``; a
    :class:`ShardingConfigError` naming ``variable`` where it is no hostlist."""
    depth, end = 0, len(nodelist)
    for index, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = index
            break
    first = nodelist[:end]
    if not _HOSTLIST_ELEMENT.fullmatch(first):
        raise ShardingConfigError(
            f"Slurm's {variable}={nodelist} is not a list of hosts (such as "
            f"gpu[07-09,12],cpu1): {_WHAT_TO_DO}")
    # keep the first number of every bracketed range
    return re.sub(r"\[([0-9]+)[^\]]*\]", r"\1", first)


def _slurm_number(environ: Mapping[str, str], name: str, what: str, default: str = "") -> int:
    """Slurm's variable ``name`` as a number (``default`` where it is not set); a
    :class:`ShardingConfigError` saying it is ``what`` where it is not a number."""
    value = environ.get(name, default)
    if not re.fullmatch(r"[0-9]+", value):
        raise ShardingConfigError(
            f"Slurm's {name}={value} is not a number ({what}): {_WHAT_TO_DO}")
    return int(value)


def _tasks_on_node(tasks_per_node: str, node_id: int,
                   variable: str = "SLURM_TASKS_PER_NODE") -> int:
    """Slurm's ``SLURM_TASKS_PER_NODE`` (``2(x3),1``, read from ``variable``) for node
    ``node_id``."""
    node = 0
    for item in tasks_per_node.split(","):
        found = re.fullmatch(r"([0-9]+)(?:\(x([0-9]+)\))?", item)
        if found is None:
            raise ShardingConfigError(
                f"Slurm's {variable}={tasks_per_node} is not a list of task counts per node "
                f"(such as 2(x3),1): {_WHAT_TO_DO}")
        node += int(found[2] or 1)
        if node_id < node:
            return int(found[1])
    raise ShardingConfigError(f"Slurm's {variable}={tasks_per_node} has no node "
                              f"{node_id} (SLURM_NODEID): {_WHAT_TO_DO}")


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
    tasks = _slurm_number(environ, "SLURM_NTASKS", "the job step's tasks")
    nodelist_variable = ("SLURM_STEP_NODELIST" if environ.get("SLURM_STEP_NODELIST")
                         else "SLURM_JOB_NODELIST" if "SLURM_JOB_NODELIST" in environ else None)
    if nodelist_variable is None or tasks < 2:
        return {}
    _slurm_number(environ, "SLURM_PROCID", "this task's rank")
    _slurm_number(environ, "SLURM_LOCALID", "this task's rank on its node")
    tasks_per_node_variable = next(
        name for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                          "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS") if environ.get(name))
    local_ranks = _tasks_on_node(
        environ[tasks_per_node_variable],
        _slurm_number(environ, "SLURM_NODEID", "this node's index in the job", "0"),
        tasks_per_node_variable)
    if local_ranks == 1 and cuda_devices > 1:
        return {}
    if port <= 0:
        port = 20000 + _slurm_number(environ, "SLURM_JOB_ID", "the job's id", "0") % 20000
    nodelist = environ[nodelist_variable]
    return {
        "MASTER_ADDR": first_slurm_host(nodelist, nodelist_variable),
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
