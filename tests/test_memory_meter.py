"""The CPU meters: the live-tensor meter counts real allocations, frees and FSDP-style
storage resizes; the allocator meter reads the allocator's events without changing what
autograd does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fairseq_shard_plugin.memory.allocator_meter import AllocatorMeter
from fairseq_shard_plugin.memory.meters import LiveTensorMeter, StepMemoryProbe, storage_bytes


def test_counts_resident_and_new_tensors_and_frees() -> None:
    weight = torch.randn(256, 256)
    with LiveTensorMeter([weight]) as meter:
        assert meter.live_bytes == 256 * 256 * 4
        activation = torch.randn(512, 256)  # +512 KiB
        product = activation @ weight  # +512 KiB
        del activation, product
        assert meter.live_bytes == 256 * 256 * 4
    assert meter.peak_bytes == (256 * 256 + 2 * 512 * 256) * 4


def test_views_share_storage_and_are_counted_once() -> None:
    with LiveTensorMeter() as meter:
        base = torch.zeros(1000)
        views = [base[i:] for i in range(10)]
        assert {view.untyped_storage().data_ptr() for view in views} == {
            base.untyped_storage().data_ptr()}
        assert meter.live_bytes == 4000
    assert meter.peak_bytes == 4000


def test_follows_storage_resize_like_fsdp_reshard() -> None:
    with LiveTensorMeter() as meter:
        gathered = torch.empty(1000)
        gathered.untyped_storage().resize_(0)  # FSDP frees a gathered parameter this way
        assert meter.live_bytes == 0
        gathered.untyped_storage().resize_(8000)  # and regrows it before the next use
        assert meter.live_bytes == 8000
    assert meter.peak_bytes == 8000


def test_storage_bytes_counts_shared_storage_once() -> None:
    tensor = torch.zeros(10, 10)
    assert storage_bytes([tensor, tensor.view(100), tensor[0]]) == 400


def test_metering_leaves_autograd_gradient_accumulation_in_place() -> None:
    """A weight used three times (like a tied vocabulary matrix) has its gradients summed in
    place by autograd; under the dispatch-mode meter that sum is out of place (+1 copy)."""
    weight = torch.randn(4096, 256, requires_grad=True)  # 4 MiB
    tokens = torch.randint(0, 4096, (16,))
    with AllocatorMeter([weight]) as meter:
        uses = [F.embedding(tokens, weight) for _ in range(3)]
        sum(use.sum() for use in uses).backward()
    weight_bytes = 4096 * 256 * 4
    # autograd's result is unchanged: each use adds 1 per occurrence of a token to its row
    expected = torch.zeros_like(weight).index_add_(0, tokens, torch.full((16, 256), 3.0))
    assert weight.grad is not None and torch.equal(weight.grad, expected)
    # the weight, the gradient summed so far and the one being added; small tensors aside
    assert 3 * weight_bytes <= meter.peak_bytes < 3.25 * weight_bytes
    with LiveTensorMeter([weight]) as perturbing:
        uses = [F.embedding(tokens, weight) for _ in range(3)]
        sum(use.sum() for use in uses).backward()
    assert perturbing.peak_bytes >= 4 * weight_bytes


def test_probe_records_marks_and_skips_steps_it_cannot_measure() -> None:
    probe = StepMemoryProbe(torch.device("cpu"), meter=AllocatorMeter)
    probe.start([])
    probe.mark("before")
    tensor = torch.zeros(256)
    probe.mark("after")
    step = probe.stop()
    assert step is not None and step.marks == {"before": 0, "after": 1024}
    del tensor  # alive until the probe stopped: its 1,024 B are the "after" mark
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        probe.start([])  # the user's own profiler owns the allocator events
        assert probe.stop() is None


def test_allocator_meter_counts_new_tensors_marks_and_host_side_storages() -> None:
    shard = torch.zeros(1000)  # 4,000 B, offloaded from the start
    with AllocatorMeter([], host=[shard]) as meter:
        activation = torch.ones(2000)  # 8,000 B on the device
        meter.mark("activation")
        grad = activation[:500] * 2  # 2,000 B, then copied to the host
        meter.mark_host(grad)
        del activation
        meter.host_phase = True  # an optimizer step on the host
        state = torch.zeros_like(shard)
        meter.host_phase = False
    # the allocator also sees a few scalar-sized buffers of its own (under 64 bytes each)
    assert 12000 <= meter.marks["activation"] < 12000 + 256
    assert 14000 <= meter.peak_bytes < 14000 + 256
    assert 10000 <= meter.device_peak_bytes < 10000 + 256
    assert 10000 <= meter.host_bytes < 10000 + 256
    del state  # alive until the meter closed: its 4,000 B are counted on the host


def test_peaks_across_resets_keep_the_largest_peak_before_each_reset() -> None:
    """fairseq's train_step resets CUDA's peak statistics every update: the measuring
    launcher folds each step's peak into a running maximum before the reset goes through."""
    from fairseq_shard_plugin.cli.measure_train import PeaksAcrossResets

    allocator = {"now": 0, "peak": 0}
    resets: list[object] = []

    def allocate(nbytes: int) -> None:
        allocator["now"] += nbytes
        allocator["peak"] = max(allocator["peak"], allocator["now"])

    def reset(device: object = None) -> None:
        resets.append(device)
        allocator["peak"] = allocator["now"]

    peaks = PeaksAcrossResets(reset, {"allocated": lambda device=None: allocator["peak"]})
    allocate(500)
    allocate(-400)  # step 1 peaked at 500
    peaks.reset("cuda:0")
    allocate(200)
    allocate(-200)  # step 2 peaked at 300
    peaks.reset()
    assert resets == ["cuda:0", None] and allocator["peak"] == 100  # the resets went through
    allocate(50)
    assert peaks.fold() == {"allocated": 500}
    allocate(1000)
    assert peaks.fold() == {"allocated": 1150}  # the current peak counts too


@pytest.mark.e2e
def test_the_measuring_launcher_activates_the_plugin_given_as_user_dir_equals(
    corpus: Path, tmp_path: Path
) -> None:
    """``--user-dir=PATH`` (one argument) names the plugin as ``--user-dir PATH`` does: the
    launcher has imported the package, so fairseq would skip the user dir unless the
    launcher activates it (else ``--task sharded_translation`` is unknown)."""
    from launching.harness import (
        PLUGIN_DIR,
        rank_environment,
        start_ranks,
        tool,
        training_args,
        transformer_args,
    )

    args = training_args(corpus, tmp_path / "save", max_update=1, max_tokens=256)
    args += transformer_args(dim=32, ffn=64, layers=1, heads=2) + [
        "--no-save", "--disable-validation", f"--user-dir={PLUGIN_DIR}",
        "--task", "sharded_translation", "--ddp-backend", "fully_sharded"]
    command = [tool("fairseq-shard-measure-train"), "--measure-out",
               str(tmp_path / "measured_{rank}.json"), *args]
    code, output = start_ranks(command, 1, rank_environment())
    assert code == 0, output[-3000:]
    assert (tmp_path / "measured_0.json").is_file()
