"""Run under torchrun: fairseq's Adam on local shards against Adam on the DTensors.

Usage: torchrun --nproc_per_node 2 local_shard_steps.py REPORT.json
Two identical FSDP2 models (uneven shards: 33 and 7 rows over 2 ranks) take the same
steps with clipping and a deferred gradient factor; one optimizer updates the DTensor
parameters, the other plain tensors on their local shards. Rank 0 writes what matched.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from fairseq.optim.adam import FairseqAdam
from omegaconf import OmegaConf
from process_group import leave_process_group
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fairseq_shard_plugin.sharding.full_state import gather_full_state
from fairseq_shard_plugin.sharding.gradients import global_grad_norm
from fairseq_shard_plugin.sharding.local_shards import LocalShards
from fairseq_shard_plugin.sharding.precision import ShardedMasterOptimizer

STEPS = 6
ADAM = {"adam_betas": "(0.9, 0.98)", "adam_eps": 1e-8, "weight_decay": 0.01, "lr": [3e-2],
        "use_old_adam": False, "fp16_adam_stats": False, "tpu": False}


def sharded_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 7))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    return fully_shard(model)


def optimizer(model: torch.nn.Module, local: bool) -> ShardedMasterOptimizer:
    cfg = SimpleNamespace(optimizer=OmegaConf.create(ADAM))
    params = list(model.parameters())
    shards = LocalShards(params) if local else None
    adam = FairseqAdam(cfg.optimizer, shards.locals if shards else params)
    return ShardedMasterOptimizer(cfg, adam, scaler=None, shards=shards)


def train(model: torch.nn.Module, opt: ShardedMasterOptimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed + dist.get_rank())
    for _ in range(steps):
        inputs = torch.randn(8, 16, generator=generator)
        model(inputs).pow(2).sum().backward()
        opt.multiply_grads(0.5)  # fairseq's gradient normalisation, deferred
        opt.apply_norm(global_grad_norm(opt.params, torch.device("cpu")), max_norm=0.1)
        opt.step()
        opt.zero_grad()


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return gather_full_state(dict(model.state_dict()))


def main() -> None:
    dist.init_process_group("gloo")
    reference, local = sharded_model(), sharded_model()
    reference_opt, local_opt = optimizer(reference, False), optimizer(local, True)
    train(reference, reference_opt, STEPS, seed=1)
    train(local, local_opt, STEPS, seed=1)
    ref_params, local_params = full_params(reference), full_params(local)
    ref_state, local_state = reference_opt.state_dict(), local_opt.state_dict()
    state_is_sharded = all(
        isinstance(value, DTensor) and value.placements == param.placements
        for param, entry in zip(local_opt.params, local_state["state"].values(), strict=True)
        for key, value in entry.items() if key != "step"
    )
    # Loading: DTensor state into a fresh local-shard optimizer, full state into another.
    reloaded = {}
    for name, state in (("dtensor", local_state), ("full", gather_full_state(ref_state))):
        model = sharded_model()
        model.load_state_dict(local.state_dict())
        opt = optimizer(model, True)
        opt.load_state_dict(state)
        train(model, opt, 2, seed=2)
        reloaded[name] = full_params(model)
    train(reference, reference_opt, 2, seed=2)
    after = full_params(reference)
    report = {
        "params_equal": all(torch.equal(ref_params[k], local_params[k]) for k in ref_params),
        "params_changed": not any(
            torch.equal(local_params[k], full_params(sharded_model())[k]) for k in local_params),
        "state_equal": all(
            torch.equal(value, gather_full_state(local_state)["state"][index][key])
            for index, entry in gather_full_state(ref_state)["state"].items()
            for key, value in entry.items() if isinstance(value, torch.Tensor)),
        "state_is_sharded": state_is_sharded,
        "reloaded_equal": {name: all(torch.equal(after[k], params[k]) for k in after)
                           for name, params in reloaded.items()},
    }
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as out:
            json.dump(report, out)
    leave_process_group()


if __name__ == "__main__":
    main()
