"""The offloaded Adam step in the background (``sharding/host_step_overlap.py``).

In-process checks of the scheduling (forward order, each forward waiting for its own
unit, errors, state dicts) and real ``fairseq-train`` runs with ``--cpu-offload`` and 16-bit
host state, with and without the overlap: the same losses and the same saved state, bit for
bit, on one rank (scaled moments' maxima in the background too) and on two (their maxima
taken over ranks in line).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fairseq_shard_plugin.checkpoint.consolidate import read_full_state
from fairseq_shard_plugin.sharding.host_step_overlap import BackgroundHostStep, owning_units
from fairseq_shard_plugin.sharding.native_adam import native_library
from fairseq_shard_plugin.sharding.sharded_adam import ShardedAdam
from launching.harness import RunResult, in_threads, result_of, run_training, training_args

from tiny_training import TINY


class Reordered(nn.Module):
    """A root with three children whose forward runs them as c, a, b, and records, for
    each, whether its update had finished when it ran."""

    def __init__(self, finished: dict[str, bool], seen: dict[str, bool]) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
        self.scale = nn.Parameter(torch.ones(()))
        for name in ("a", "b", "c"):
            getattr(self, name).register_forward_hook(
                lambda module, args, out, name=name: seen.__setitem__(name, finished[name]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(self.c(x))) * self.scale


def units_of(model: Reordered) -> list[tuple[nn.Module, ...]]:
    return [(model.a,), (model.b,), (model.c,), (model,)]


def test_each_forward_waits_for_its_own_unit_and_jobs_run_in_forward_order() -> None:
    finished = dict.fromkeys(("a", "b", "c", "root"), False)
    seen: dict[str, bool] = {}
    model = Reordered(finished, seen)
    background = BackgroundHostStep(units_of(model))
    model(torch.ones(1, 2))  # the first forward records the order: root, c, a, b
    assert background.order() == [3, 2, 0, 1]
    started: list[str] = []

    def job(name: str) -> None:
        started.append(name)
        time.sleep(0.05)  # slower than a forward: each unit's forward must wait
        finished[name] = True

    names = ("a", "b", "c", "root")
    background.run({index: (lambda name=name: job(name)) for index, name in enumerate(names)})
    model(torch.ones(1, 2))
    assert started == ["root", "c", "a", "b"]
    assert seen == {"a": True, "b": True, "c": True}
    assert background.take_waited_seconds() > 0.1
    background.close()


def test_a_failed_update_is_raised_where_its_unit_is_needed() -> None:
    model = Reordered(dict.fromkeys("abc", True), {})
    background = BackgroundHostStep(units_of(model))

    def fails() -> None:
        raise RuntimeError("the C host Adam step could not join its threads")

    background.run({1: fails})
    with pytest.raises(RuntimeError, match="could not join its threads"):
        model(torch.ones(1, 2))
    background.close()


def test_state_dicts_wait_for_every_update() -> None:
    model = Reordered(dict.fromkeys("abc", True), {})
    background = BackgroundHostStep(units_of(model))
    release = threading.Event()

    def update() -> None:
        release.wait(5)
        with torch.no_grad():
            model.b.weight.fill_(7.0)

    background.run({1: update})
    threading.Timer(0.05, release.set).start()
    assert bool((model.state_dict()["b.weight"] == 7.0).all())
    background.run({1: update})  # loading waits too: the update must not overwrite it
    release.set()
    model.load_state_dict({**model.state_dict(), "b.weight": torch.zeros(2, 2)})
    assert bool((model.b.weight == 0).all())
    background.close()


def test_parameters_belong_to_their_nearest_unit_and_tied_ones_to_the_first() -> None:
    model = Reordered({}, {})
    model.c.weight = model.a.weight  # tied: a comes first in module order
    owners = owning_units(model, units_of(model))
    assert owners[id(model.a.weight)] == 0
    assert owners[id(model.b.bias)] == 1
    assert owners[id(model.c.bias)] == 2
    assert owners[id(model.scale)] == 3
    with pytest.raises(ValueError, match="root module"):
        owning_units(model, units_of(model)[:3])


def adam_steps(dtype: torch.dtype, fp16_moments: bool, background: bool
               ) -> tuple[list[torch.Tensor], dict]:
    """Four Adam steps over Reordered's parameters, each followed by a forward (which waits
    for its units in the background case); the parameters and the last state."""
    torch.manual_seed(0)
    model = Reordered(dict.fromkeys("abc", True), {}).to(dtype)
    params = list(model.parameters())
    optimizer = ShardedAdam(params, lr=1e-2, betas=(0.9, 0.98), eps=1e-6,
                            weight_decay=0.01, fp16_moments=fp16_moments)
    if background:
        units = units_of(model)
        owners = owning_units(model, units)
        optimizer.run_in_background(BackgroundHostStep(units),
                                    {id(p): owners[id(p)] for p in params}, len(units) - 1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(dtype)
        optimizer.step(grad_factor=1 / 3)
        model(torch.ones(1, 2, dtype=dtype))
    return [p.detach().clone() for p in params], optimizer.state_dict()


@pytest.mark.skipif(native_library() is None, reason="no C compiler here")
@pytest.mark.parametrize(("dtype", "fp16_moments"), [
    (torch.float32, False), (torch.bfloat16, False), (torch.float16, True)])
def test_the_background_step_is_the_step_in_line_bit_for_bit(
        dtype: torch.dtype, fp16_moments: bool) -> None:
    """fp32 state too: in the background it takes the C step, torch's fused arithmetic."""
    (ours, our_state), (reference, state) = (
        adam_steps(dtype, fp16_moments, background) for background in (True, False))
    for a, b in zip(ours, reference, strict=True):
        assert torch.equal(a, b)
    for index, entry in state["state"].items():
        for key, value in entry.items():
            same = (torch.equal(our_state["state"][index][key], value)
                    if isinstance(value, torch.Tensor) else our_state["state"][index][key] == value)
            assert same, (index, key)


UPDATES = 6


def overlap_run(corpus: Path, save_dir: Path, nproc: int, overlap: bool,
                *flags: str) -> RunResult:
    args = training_args(corpus, save_dir, UPDATES) + TINY + [
        "--task", "sharded_translation", "--no-epoch-checkpoints", "--cpu-offload",
        "--memory-efficient-bf16", "--fp16-adam-stats", "--checkpoint-format", "full",
        "--save-interval-updates", "2", "--validate-interval-updates", "3", *flags]
    return run_training(args + ([] if overlap else ["--no-host-step-overlap"]), nproc=nproc,
                        plugin=True)


@pytest.mark.e2e
@pytest.mark.parametrize("nproc", [1, 2])
def test_the_background_step_trains_bit_for_bit_as_the_step_in_line(
        corpus: Path, tmp_path: Path, nproc: int) -> None:
    """Saves every 2 updates and validation every 3 read the state between updates; a
    resume from update 4 loads into the background step and ends on the same state. On 2
    ranks the background run groups each stack's 2 layers into one unit (a unit's step then
    spans several layers) and its resume does not: neither changes a bit."""
    grouped = ["--layers-per-unit", "2"] if nproc == 2 else []
    runs = in_threads({name: (lambda name=name: overlap_run(
        corpus, tmp_path / name, nproc, name == "overlap",
        *(grouped if name == "overlap" else [])))
        for name in ("overlap", "inline")})
    overlap, inline = result_of(runs, "overlap"), result_of(runs, "inline")
    assert "runs unit by unit in the background" in overlap.output
    units = "2 layer units (encoder.layers.0-1" if grouped else "4 layer units"
    assert f"sharded over {nproc} ranks with fsdp2: {units}" in overlap.output
    assert "runs unit by unit" not in inline.output
    for key in ("loss", "gnorm"):
        assert overlap.series("train_inner", key) == inline.series("train_inner", key), key
    assert overlap.series("valid", "valid_loss") == inline.series("valid", "valid_loss")
    assert len(overlap.series("train_inner", "host_wait")) == UPDATES
    resumed = overlap_run(corpus, tmp_path / "resumed", nproc, True, "--restore-file",
                          str(tmp_path / "overlap" / "checkpoint_1_4.pt"))
    assert resumed.series("train_inner", "loss") == overlap.series("train_inner", "loss")[4:]
    ours, reference, again = (read_full_state(tmp_path / name / "checkpoint_last.pt")
                              for name in ("overlap", "inline", "resumed"))
    for name, tensor in reference["model"].items():
        assert torch.equal(ours["model"][name], tensor), name
        assert torch.equal(again["model"][name], tensor), name
    states = (state["last_optimizer_state"]["state"] for state in (ours, reference))
    for (index, entry), (_, expected) in zip(*(sorted(s.items()) for s in states),
                                             strict=True):
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(entry[key], value), (index, key)
            else:
                assert entry[key] == value, (index, key)


@pytest.mark.e2e
def test_without_a_compiler_the_log_says_the_step_runs_in_line_once(
        corpus: Path, tmp_path: Path) -> None:
    """The log said the step ran in the background while the torch route ran in line, and
    the missing compiler's warning came from every rank of the node."""
    args = training_args(corpus, tmp_path, 2) + TINY + [
        "--task", "sharded_translation", "--cpu-offload", "--memory-efficient-bf16",
        "--fp16-adam-stats"]
    run = run_training(args, nproc=2, plugin=True,
                       environment={"CC": str(tmp_path / "no-such-cc")})
    assert run.output.count("no C compiler (CC=") == 1
    assert "host's Adam step runs in torch, in line after backward" in run.output
    assert "in the background" not in run.output
