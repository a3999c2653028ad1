"""Run under torchrun (gloo, CPU): apply the fairscale engine to a real fairseq model.

Usage: torchrun --nproc_per_node N inspect_fairscale.py OUT_DIR VARIANTS_JSON DATA [args...]
VARIANTS_JSON maps a variant name to extra fairseq flags. For each variant a fresh model
is built and sharded with ``--shard-engine fairscale`` (``compute_device=cpu``: fairscale
constructs on CPU, it only trains on CUDA). Writes OUT_DIR/rank{R}.json with, per FSDP
instance, its flags and whether this rank's flat shard is exactly its 1/N slice of the
unsharded weights; the tie of the vocabulary; activation checkpointing; round trips
of the gradient norm and of the checkpoint (optimizer-state) gathering, on known values;
and one forward/backward against the unsharded model, with fairscale's CUDA stream calls
made no-ops (``cpu_streams``: CPUs have one stream).
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from cpu_streams import emulate_cuda_streams_on_cpu
from fairscale.nn.data_parallel import FullyShardedDataParallel
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from process_group import leave_process_group

import fairseq_shard_plugin
from fairseq_shard_plugin.sharding.engines import build_engine
from fairseq_shard_plugin.sharding.engines import fairscale as engine
from fairseq_shard_plugin.sharding.gradients import global_grad_norm
from fairseq_shard_plugin.sharding.options import sharding_options
from fairseq_shard_plugin.sharding.settings import ReshardPolicy, ShardingSettings
from fairseq_shard_plugin.sharding.wrap_policy import LAYER_CLASSES, build_plan

fairseq_shard_plugin.activate()  # as --user-dir does


def _expected_shard(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    chunks = full.chunk(world)
    mine = chunks[rank] if rank < len(chunks) else full[:0]
    return torch.cat([mine, full.new_zeros(chunks[0].numel() - mine.numel())])


def _checkpointed_by_fairscale(layer: torch.nn.Module) -> bool:
    forward = layer.__dict__.get("forward")
    return (isinstance(forward, functools.partial)
            and forward.func.__module__ == "fairscale.nn.checkpoint.checkpoint_activations"
            and not hasattr(layer, "precheckpoint_forward"))


def inspect(fairseq_args: list[str]) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    args = options.parse_args_and_arch(options.get_training_parser(), fairseq_args)
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    reference = task.build_model(cfg.model)
    torch.manual_seed(0)
    model = task.build_model(cfg.model)
    full = {id(p): p.detach().clone() for p in model.parameters()}
    opts = sharding_options(cfg.task)
    plan = build_plan(model, ReshardPolicy(root=not opts.keep_root_gathered))
    unit_modules = {id(unit.modules[0]): unit.name for unit in plan.units}
    # flat layout of each unit: its module's parameters, in order, before wrapping
    layout = {unit.name: [full[id(p)] for p in unit.modules[0].parameters()]
              for unit in plan.units}
    claimed = {id(p) for unit in plan.units for m in unit.modules for p in m.parameters()}
    layout["<root>"] = [full[id(p)] for p in model.parameters() if id(p) not in claimed]
    layers = [m for m in model.modules() if isinstance(m, LAYER_CLASSES)]
    wrapped_by_fairseq = [hasattr(layer, "precheckpoint_forward") for layer in layers]

    settings = ShardingSettings.from_config(cfg, dist.get_world_size(), use_cuda=False)
    eng = build_engine(replace(settings, engine="fairscale"))
    root = eng.shard(model, plan)
    root._lazy_init()  # fairscale settles the root's resharding here

    units = {}
    for fsdp in unit_instances(root):
        inner = fsdp.module.module
        name = "<root>" if fsdp is root else unit_modules[id(inner)]
        (flat,) = fsdp.params
        expected = torch.cat([t.flatten() for t in layout[name]])
        units[name] = {
            "module": type(inner).__name__,
            "local_numel": flat.numel(), "full_numel": expected.numel(),
            "slice_matches": torch.equal(flat.detach(), _expected_shard(expected, world, rank)),
            "flatten_parameters": fsdp.flatten_parameters,
            "mixed_precision": fsdp.mixed_precision,
            "compute_dtype": str(fsdp.compute_dtype),
            "fp32_reduce_scatter": fsdp.fp32_reduce_scatter,
            "reshard_after_forward": fsdp.reshard_after_forward,
        }
    decoder = root.module.module.decoder
    projection = decoder.output_projection
    vocabulary = [f for f in unit_instances(root)
                  if isinstance(f.module.module, engine.TiedEmbedding)]
    tie = {
        "vocabulary_units": len(vocabulary),
        "projection_uses_it": isinstance(projection, engine.TiedOutputProjection)
        and projection._vocabulary[0] is vocabulary[0]
        and decoder.embed_tokens is vocabulary[0],
        "projection_params": sum(1 for _ in projection.parameters()),
        "tied_keys": root.tied_keys,
    }
    params = list(root.parameters())
    unique = sum(t.numel() for t in full.values())
    step = _step_against_reference(task, cfg, reference, root)
    return {
        "layers_are_units": all(
            any(isinstance(f, FullyShardedDataParallel) and f.module.module is layer
                for f in unit_instances(root)) for layer in layers),
        "layers_checkpointed": [_checkpointed_by_fairscale(layer) for layer in layers],
        "layers_checkpointed_by_fairseq_before": wrapped_by_fairseq,
        "units": units, "tie": tie,
        "held_fraction": sum(p.numel() for p in params) / unique,
        "grad_norm": _grad_norm_round_trip(params),
        "optimizer_state": _optimizer_state_round_trip(params),
        "step": step,
    }


def _step_against_reference(task: Any, cfg: Any, reference: torch.nn.Module,
                            root: torch.nn.Module) -> dict[str, float]:
    """Loss and gradient norm of one batch (the same on every rank, so the averaged
    sharded gradient equals the unsharded one), sharded vs the unsharded fp32 model;
    twice, so the second forward re-gathers after resharding."""
    task.load_dataset("train")
    criterion = task.build_criterion(cfg.criterion)
    batches = task.get_batch_iterator(task.dataset("train"), max_tokens=256, seed=1)
    sample = next(batches.next_epoch_itr(shuffle=False))
    loss, _, _ = criterion(reference, sample)
    loss.backward()
    result = {"reference_loss": loss.item(), "reference_norm": torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in reference.parameters() if p.grad is not None])
    ).item()}
    for attempt in range(2):
        loss, _, _ = criterion(root, sample)
        loss.backward()
        params = list(root.parameters())
        result[f"loss{attempt}"] = loss.item()
        result[f"norm{attempt}"] = global_grad_norm(
            params, torch.device("cpu"), engine.flat_shard).item()
        for param in params:
            param.grad = None
    return result


def _known_full(param: torch.Tensor, salt: int) -> torch.Tensor:
    """The same pseudo-random full flat tensor on every rank."""
    generator = torch.Generator().manual_seed(1000 + salt)
    return torch.randn(param._orig_size.numel(), generator=generator)


def _grad_norm_round_trip(params: list[torch.Tensor]) -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    fulls = [_known_full(p, i) for i, p in enumerate(params)]
    for param, full_grad in zip(params, fulls, strict=True):
        param.grad = _expected_shard(full_grad, world, rank)
    sharded = global_grad_norm(params, torch.device("cpu"), engine.flat_shard).item()
    for param in params:
        param.grad = None
    return {"sharded": sharded, "unsharded": torch.cat(fulls).norm().item()}


def _optimizer_state_round_trip(params: list[torch.Tensor]) -> dict[str, bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.Adam(params)
    fulls = [_known_full(p, 100 + i) for i, p in enumerate(params)]
    for param, full in zip(params, fulls, strict=True):
        optimizer.state[param] = {"step": torch.tensor(3.0),
                                  "exp_avg": _expected_shard(full, world, rank),
                                  "exp_avg_sq": _expected_shard(full, world, rank).abs()}
    gathered = engine.full_optimizer_state(optimizer.state_dict(), optimizer)
    gathered_ok = all(torch.equal(gathered["state"][i]["exp_avg"], full)
                      for i, full in enumerate(fulls))
    reloaded = torch.optim.Adam(params)
    reloaded.load_state_dict(gathered)
    engine.shard_loaded_optimizer_state(reloaded)
    sliced_ok = all(
        torch.equal(reloaded.state[p][key], optimizer.state[p][key])
        for p in params for key in ("exp_avg", "exp_avg_sq"))
    return {"gathered_is_full": gathered_ok, "reloaded_is_local_slice": sliced_ok}


def unit_instances(root: torch.nn.Module) -> list[FullyShardedDataParallel]:
    """Every fairscale FSDP instance under (and including) ``root``, in module order."""
    return [m for m in root.modules() if isinstance(m, FullyShardedDataParallel)]


def main() -> None:
    out_dir, variants, fairseq_args = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:]
    emulate_cuda_streams_on_cpu()
    dist.init_process_group("gloo")
    report = {"world": dist.get_world_size()}
    for name, extra in variants.items():
        report[name] = inspect(fairseq_args + extra)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    leave_process_group()


if __name__ == "__main__":
    main()
