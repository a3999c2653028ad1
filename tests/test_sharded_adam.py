"""The plugin's Adam (sharding/sharded_adam.py) in one process: fairseq's update over fp32
or 16-bit tensors, 16-bit moments in FusedAdamV1's layout, pieces, and reloading; each on
both host steps for 16-bit state (the C one, and torch's, used without a compiler)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fairseq import utils as fairseq_utils
from fairseq.optim.adam import Adam as FairseqAdam

from fairseq_shard_plugin.sharding import sharded_adam
from fairseq_shard_plugin.sharding.optimizer import uses_sharded_adam
from fairseq_shard_plugin.sharding.settings import ShardingSettings
from fairseq_shard_plugin.sharding.sharded_adam import ShardedAdam, with_fp32_moments
from launching.harness import REPO, run_helper

from tiny_training import TINY

SHAPES = [(48, 32), (32,), (0, 8), (1000,)]


@pytest.fixture(autouse=True, params=["C step", "torch step"])
def host_step(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.param == "torch step":
        if request.node.get_closest_marker("e2e"):
            pytest.skip("ranks take the C step; torch's is covered in one process")
        monkeypatch.setattr(sharded_adam, "native_library", lambda: None)
    elif sharded_adam.native_library() is None:
        pytest.skip("no C compiler here")
SETTINGS = dict(lr=1e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
STEPS = 10


def gradients(steps: int = STEPS) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [[torch.randn(shape, generator=generator) * 1e-3 for shape in SHAPES]
            for _ in range(steps)]


def start_params(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(dtype).requires_grad_()
            for shape in SHAPES]


def train(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
          grads: list[list[torch.Tensor]], factor: float = 1.0) -> None:
    """Steps with gradients stored divided by ``factor`` (as a loss scale leaves them)."""
    for step_grads in grads:
        for param, grad in zip(params, step_grads, strict=True):
            param.grad = (grad / factor).to(param.dtype)
        if isinstance(optimizer, ShardedAdam):
            optimizer.step(grad_factor=factor)
        else:
            for param in params:
                param.grad.mul_(factor)
            optimizer.step()


def trained(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
            dtype: torch.dtype = torch.float32, factor: float = 1.0
            ) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    params = start_params(dtype)
    optimizer = make(params)
    train(optimizer, params, gradients(), factor)
    return params, optimizer


def assert_params_close(ours: list[torch.Tensor], reference: list[torch.Tensor],
                        rtol: float, atol: float) -> None:
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=rtol, atol=atol)


def test_fp32_state_updates_as_fairseqs_adam() -> None:
    """fairseq's formula (epsilon before the bias correction) within fp32 rounding, with
    the loss-scale factor applied inside the step."""
    reference, _ = trained(lambda params: FairseqAdam(params, **SETTINGS))
    ours, optimizer = trained(lambda params: ShardedAdam(params, **SETTINGS), factor=1 / 512)
    assert_params_close(ours, reference, rtol=1e-5, atol=1e-6)
    state = optimizer.state[ours[0]]
    assert state["exp_avg"].dtype == torch.float32 and state["step"] == STEPS


@pytest.mark.parametrize("factor", [1.0, 1 / 512], ids=["unscaled", "loss-scaled"])
def test_fp16_moments_take_fused_adam_v1_layout_and_track_fp32(factor: float) -> None:
    """Also with fp32 gradients that a loss scale left scaled (``--fp16 --fp16-adam-stats``):
    the factor is applied once, in both passes over the gradients."""
    reference, fp32 = trained(lambda params: ShardedAdam(params, **SETTINGS))
    ours, optimizer = trained(lambda params: ShardedAdam(params, fp16_moments=True, **SETTINGS),
                              factor=factor)
    assert_params_close(ours, reference, rtol=1e-4, atol=1e-5)
    for param, fp32_param in zip(ours[:2], reference[:2], strict=True):  # not the empty one
        state, fp32_state = optimizer.state[param], fp32.state[fp32_param]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq", "exp_avg_scale",
                              "exp_avg_sq_scale"}
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float16
        for key in ("exp_avg", "exp_avg_sq"):
            exact = fp32_state[key]
            # FusedAdamV1's scale: the largest magnitude maps to fp16's largest value
            expected_scale = 1e-8 + float(exact.abs().max()) / 65504
            assert state[f"{key}_scale"] == pytest.approx(expected_scale, rel=1e-3)
            restored = state[key].float() * state[f"{key}_scale"]
            # fp16 keeps 11 significant bits of the largest moment; ten steps of rounding
            torch.testing.assert_close(restored, exact, rtol=0, atol=5e-3 * float(
                exact.abs().max()))


def test_16_bit_parameters_are_updated_in_fp32_and_rounded() -> None:
    reference, _ = trained(lambda params: ShardedAdam(params, **SETTINGS))
    ours, optimizer = trained(
        lambda params: ShardedAdam(params, fp16_moments=True, **SETTINGS),
        dtype=torch.float16, factor=1 / 1024)
    assert all(param.dtype == torch.float16 for param in ours)
    # within a few fp16 steps (1/1024 relative) of the fp32 run: each step rounds
    assert_params_close(ours, reference, rtol=5e-3, atol=1e-3)
    # the update moved every parameter by more than fp16 rounds away
    moved = [(a.float() - b).abs().max() for a, b in zip(ours, start_params(), strict=True)
             if a.numel()]
    assert min(moved) > 5e-3


@pytest.mark.parametrize("fp16_moments", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pieces_and_chunks_do_not_change_the_update(
    monkeypatch: pytest.MonkeyPatch, fp16_moments: bool, dtype: torch.dtype
) -> None:
    """Large parameters are updated in pieces (bounded fp32 copies): the same update, up
    to the kernel's vectorisation of other element runs (fp32 rounding; in bf16 an
    occasional neighbouring value)."""
    def make(params: list[torch.Tensor]) -> ShardedAdam:
        return ShardedAdam(params, fp16_moments=fp16_moments, **SETTINGS)

    whole, whole_optimizer = trained(make, dtype)
    monkeypatch.setattr(sharded_adam, "CHUNK_ELEMENTS", 7)
    pieces, pieces_optimizer = trained(make, dtype)
    rtol = 1e-5 if dtype == torch.float32 else 8e-3
    for a, b in zip(whole, pieces, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            whole_moment = whole_optimizer.state[a][key].float()
            largest = float(whole_moment.abs().max()) if whole_moment.numel() else 0.0
            torch.testing.assert_close(whole_moment, pieces_optimizer.state[b][key].float(),
                                       rtol=0, atol=1e-3 * largest)


@pytest.mark.parametrize("fp16_moments", [False, True])
def test_a_reloaded_state_continues_exactly(fp16_moments: bool) -> None:
    grads = gradients()
    uninterrupted = start_params(torch.float16)
    train(ShardedAdam(uninterrupted, fp16_moments=fp16_moments, **SETTINGS), uninterrupted,
          grads)
    first = start_params(torch.float16)
    optimizer = ShardedAdam(first, fp16_moments=fp16_moments, **SETTINGS)
    train(optimizer, first, grads[:4])
    resumed = [param.detach().clone().requires_grad_() for param in first]
    reloaded = ShardedAdam(resumed, fp16_moments=fp16_moments, **SETTINGS)
    # as a checkpoint holds it: fairseq's writer turns every 16-bit tensor into fp32
    reloaded.load_state_dict(fairseq_utils.move_to_cpu(optimizer.state_dict()))
    moment_dtype = torch.float16 if fp16_moments else torch.float32
    assert reloaded.state[resumed[0]]["exp_avg"].dtype == moment_dtype  # torch would cast
    train(reloaded, resumed, grads[4:])
    for a, b in zip(uninterrupted, resumed, strict=True):
        assert torch.equal(a, b)


def test_moments_convert_between_fp32_and_fp16_checkpoints() -> None:
    fp32_params, fp32_optimizer = trained(lambda params: ShardedAdam(params, **SETTINGS))
    fp32_state = fp32_optimizer.state_dict()
    # an fp32 checkpoint into a --fp16-adam-stats run: quantized once, at load
    params = [param.detach().clone().requires_grad_() for param in fp32_params]
    sixteen = ShardedAdam(params, fp16_moments=True, **SETTINGS)
    sixteen.load_state_dict(fp32_state)
    state = sixteen.state[params[0]]
    assert state["exp_avg"].dtype == torch.float16
    exact = fp32_optimizer.state[fp32_params[0]]["exp_avg"]
    torch.testing.assert_close(state["exp_avg"].float() * state["exp_avg_scale"], exact,
                               rtol=1e-3, atol=2 * state["exp_avg_scale"])
    # and back: a --fp16-adam-stats checkpoint for fairseq's own (fp32-moment) Adam
    converted = with_fp32_moments(sixteen.state_dict())["state"][0]
    assert "exp_avg_scale" not in converted and converted["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(converted["exp_avg"], exact, rtol=1e-3,
                               atol=2 * state["exp_avg_scale"])


def test_scales_come_from_the_maxima_over_ranks() -> None:
    """The maxima are handed to ``max_over_ranks`` (an all-reduce in training): what it
    returns sets every scale, so all ranks sharing a parameter store the same one."""
    seen: list[torch.Tensor] = []

    def as_if_another_rank_held_twice_as_much(maxima: torch.Tensor) -> None:
        seen.append(maxima.clone())
        maxima.mul_(2)

    params, optimizer = trained(lambda params: ShardedAdam(
        params, fp16_moments=True, max_over_ranks=as_if_another_rank_held_twice_as_much,
        **SETTINGS))
    assert len(seen) == STEPS and seen[-1].shape == (2 * len(SHAPES),)
    state = optimizer.state[params[0]]
    assert state["exp_avg_scale"] == pytest.approx(1e-8 + 2 * float(seen[-1][0]) / 65504)
    assert float(state["exp_avg"].float().abs().max()) <= 65504 / 2 + 1


def test_a_parameter_without_gradient_keeps_its_place_and_its_values() -> None:
    """Every rank hands ``max_over_ranks`` one entry per parameter, whichever of its shards
    has a gradient (an all-reduce of unequal lengths would fail), and skips the others."""
    lengths: list[int] = []
    params = start_params()
    optimizer = ShardedAdam(params, fp16_moments=True,
                            max_over_ranks=lambda maxima: lengths.append(len(maxima)),
                            **SETTINGS)
    for param, grad in zip(params, gradients(1)[0], strict=True):
        param.grad = grad
    params[0].grad = None
    before = params[0].detach().clone()
    optimizer.step()
    assert lengths == [2 * len(SHAPES)]
    assert torch.equal(params[0], before) and params[0] not in optimizer.state
    assert optimizer.state[params[1]]["step"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scales_are_the_largest_new_moments(dtype: torch.dtype) -> None:
    """The scales pass reads the stored fp16 moments and the gradient in one operation per
    moment; its maxima are those of the new moments, computed here in float64 from the same
    state and gradient (loss-scaled, over pieces)."""
    params = start_params(dtype)
    optimizer = ShardedAdam(params, fp16_moments=True, **SETTINGS)
    train(optimizer, params, gradients(3), factor=1 / 512)  # scaled fp16 moments exist
    beta1, beta2 = SETTINGS["betas"]
    before = {id(p): {key: value.clone() if isinstance(value, torch.Tensor) else value
                      for key, value in optimizer.state[p].items()} for p in params}
    grads = gradients(4)[3]
    for param, grad in zip(params, grads, strict=True):
        param.grad = (grad * 512).to(dtype)
    # as read (torch's fused kernel unscales fp32 gradients in place)
    read = [param.grad.double() / 512 for param in params]
    optimizer.step(grad_factor=1 / 512)
    for param, grad in zip(params[:2], read, strict=False):  # not the empty one
        state, old = optimizer.state[param], before[id(param)]
        first = beta1 * old["exp_avg"].double() * old["exp_avg_scale"] + (1 - beta1) * grad
        second = (beta2 * old["exp_avg_sq"].double() * old["exp_avg_sq_scale"]
                  + (1 - beta2) * grad * grad)
        assert state["exp_avg_scale"] == pytest.approx(
            1e-8 + float(first.abs().max()) / 65504, rel=1e-6)
        assert state["exp_avg_sq_scale"] == pytest.approx(
            1e-8 + float(second.max()) / 65504, rel=1e-6)


@pytest.mark.e2e
def test_every_rank_scales_16_bit_moments_by_the_largest_over_all_ranks(
    corpus: Path, tmp_path: Path
) -> None:
    """The trainer's own optimizer on 2 ranks whose gradients differ in size: each
    parameter's scale is the same on both ranks, and the rank holding the largest moment
    uses fp16's whole range. (A scale reduced by sum would leave the range half unused; one
    not reduced at all would differ between the ranks.)"""
    report = tmp_path / "report.json"
    run_helper(REPO / "tests" / "helpers" / "fp16_moment_scales.py", str(report), str(corpus),
               *TINY, "--cpu", "--task", "sharded_translation", "--ddp-backend",
               "fully_sharded", "--optimizer", "adam", "--lr", "1e-3",
               "--memory-efficient-fp16", "--fp16-adam-stats")
    found = json.loads(report.read_text())
    assert found["optimizer"] == "ShardedAdam"
    first, second = found["ranks"]
    assert len(first) == len(second) > 0
    for (scale_0, largest_0), (scale_1, largest_1) in zip(first, second, strict=True):
        assert scale_0 == scale_1
        if largest_0 or largest_1:
            assert max(largest_0, largest_1) == pytest.approx(65504, rel=1e-2)


def test_fp32_masters_on_gpus_step_with_the_fused_adam_unless_use_old_adam() -> None:
    """As stock fairseq, which takes apex's fused Adam on CUDA unless --use-old-adam; CPU
    ranks with fp32 state and the fairscale engine's few flat shards keep fairseq's Adam."""
    from omegaconf import OmegaConf

    def adam(**flags: bool) -> object:
        return OmegaConf.create({"_name": "adam", "use_old_adam": False,
                                 "fp16_adam_stats": False, **flags})

    gpu, cpu = ShardingSettings(device_type="cuda"), ShardingSettings(device_type="cpu")
    assert uses_sharded_adam(adam(), gpu)
    assert not uses_sharded_adam(adam(use_old_adam=True), gpu)
    assert not uses_sharded_adam(adam(), cpu)
    assert not uses_sharded_adam(adam(), ShardingSettings(device_type="cuda",
                                                          engine="fairscale"))
    assert uses_sharded_adam(adam(use_old_adam=True),
                             ShardingSettings(device_type="cuda", offload=True))
    sgd = OmegaConf.create({"_name": "sgd"})
    assert not uses_sharded_adam(sgd, gpu)


# operations that only make views or allocate: no kernel on a GPU
METADATA_OPS = {"aten.view.default", "aten.slice.Tensor", "aten.empty_like.default",
                "aten.select.int", "aten.unbind.int", "aten.detach.default"}


def dispatched_ops(optimizer: ShardedAdam, params: list[torch.Tensor], copies: int = 1
                   ) -> dict[str, int]:
    """The aten operations one step of the torch route dispatches, by name (a second step:
    the first creates the state); ``params`` are ``copies`` times :data:`SHAPES`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.ops[str(func)] = self.ops.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    grads = [step * copies for step in gradients(2)]
    train(optimizer, params, grads[:1], factor=1 / 512)
    for param, grad in zip(params, grads[1], strict=True):
        param.grad = (grad * 512).to(param.dtype)
    with Counting() as counting:
        optimizer.step(grad_factor=1 / 512)
    return counting.ops


@pytest.mark.parametrize("fp16_moments", [False, True])
def test_the_torch_step_reads_no_value_back_from_a_tensor(fp16_moments: bool) -> None:
    """On a GPU each value read back (``float(t)``, ``.item()``) waits for every queued
    kernel: the torch route (GPUs, no compiler) reads none. The scales pass brings the
    pieces' maxima to the host in one copy; step counts and the gradient factor are filled
    on the device rather than copied from host memory."""
    params = start_params(torch.bfloat16)
    optimizer = ShardedAdam(params, fp16_moments=fp16_moments, native=False, **SETTINGS)
    ops = dispatched_ops(optimizer, params)
    assert ops.get("aten._local_scalar_dense.default", 0) == 0


@pytest.mark.parametrize("fp16_moments", [False, True])
def test_the_torch_steps_kernels_do_not_grow_with_the_number_of_tensors(
        fp16_moments: bool) -> None:
    """Each chunk's arithmetic and copies are multi-tensor operations: a step over 4 times
    as many tensors (in one chunk) launches the same kernels on a GPU."""
    counts = []
    for copies in (1, 4):
        params = [param for _ in range(copies) for param in start_params(torch.bfloat16)]
        optimizer = ShardedAdam(params, fp16_moments=fp16_moments, native=False, **SETTINGS)
        ops = dispatched_ops(optimizer, params, copies)
        counts.append({op: n for op, n in ops.items() if op not in METADATA_OPS})
    assert counts[0] == counts[1]
