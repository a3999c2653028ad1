"""The live-tensor meter counts real allocations, frees and FSDP-style storage resizes."""

from __future__ import annotations

import torch

from fairseq_shard_plugin.memory import LiveTensorMeter, storage_bytes


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
        assert meter.live_bytes == 4000
    assert len(views) == 10 and meter.peak_bytes == 4000


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
