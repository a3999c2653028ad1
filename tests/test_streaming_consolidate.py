"""Consolidation streams tensors: torch's checkpoint format written one tensor at a time,
tensors read from a full file or DCP shards a slab at a time (small, in-process checks; the
trainings that export, and the memory bound at the NLLB-600M shape, are elsewhere:
test_checkpoints.py, benchmarks/consolidate_memory.py)."""

from __future__ import annotations

import errno
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from fairseq_shard_plugin.checkpoint import consolidate, stored_tensors
from fairseq_shard_plugin.checkpoint.atomic_files import write_atomically
from fairseq_shard_plugin.checkpoint.sharded import save_sharded
from fairseq_shard_plugin.checkpoint.streaming_writer import write_checkpoint

TIED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
        "decoder.output_projection.weight")


def training_state() -> dict[str, Any]:
    """A fairseq-like training checkpoint: tied embeddings, a bf16 and an integer tensor,
    a scalar, Adam state."""
    generator = torch.Generator().manual_seed(0)
    embedding = torch.randn(37, 6, generator=generator)
    model = {name: embedding for name in TIED}
    model.update({"layer.weight": torch.randn(6, 10, generator=generator),
                  "layer.bias": torch.randn(10, generator=generator).to(torch.bfloat16),
                  "steps": torch.arange(5), "version": torch.tensor(3.0)})
    return {"args": None, "cfg": {"model": {"arch": "tiny"}}, "model": model,
            "last_optimizer_state": {"state": {0: {"exp_avg": torch.ones(37, 6), "step": 4}},
                                     "param_groups": [{"lr": 0.1}]},
            "optimizer_history": [{"num_updates": 4}], "extra_state": {"epoch": 1}}


def test_the_streamed_format_loads_as_torch_save_writes_it(tmp_path: Path) -> None:
    state = training_state()
    state["model"]["view"] = state["model"]["layer.weight"].t()[2:]  # a strided view
    out = tmp_path / "streamed.pt"
    with open(out, "wb") as stream:
        write_checkpoint(stream, state)
    assert zipfile.ZipFile(out).testzip() is None  # every record's CRC-32
    for mmap in (False, True):
        loaded = torch.load(out, weights_only=True, mmap=mmap)
        assert loaded.keys() == state.keys() and loaded["extra_state"] == {"epoch": 1}
        for name, tensor in state["model"].items():
            assert loaded["model"][name].dtype == tensor.dtype
            assert torch.equal(loaded["model"][name], tensor), name
        assert len({id(loaded["model"][name]) for name in TIED}) == 1


@pytest.mark.parametrize("sharded", [False, True], ids=["full", "sharded"])
@pytest.mark.parametrize("dtype", [None, torch.float16], ids=["fp32", "fp16"])
def test_export_streams_the_model_in_slabs_and_leaves_the_optimizer_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sharded: bool, dtype: torch.dtype | None
) -> None:
    monkeypatch.setattr(stored_tensors, "SLAB_BYTES", 40)  # a few rows per read
    state = training_state()
    source = tmp_path / "checkpoint_last.pt"
    saved = save_sharded(state, tmp_path, num_updates=4) if sharded else state
    write_atomically(source, lambda out: torch.save(saved, out))
    out = consolidate.export_consolidated(tmp_path, tmp_path / "export" / "model.pt", dtype)
    exported = torch.load(out, weights_only=True)
    assert sorted(exported) == ["args", "cfg", "extra_state", "model", "optimizer_history"]
    for name, tensor in state["model"].items():
        expected = tensor.to(dtype) if dtype and tensor.is_floating_point() else tensor
        if sharded and dtype is None and tensor.dtype in (torch.float16, torch.bfloat16):
            expected = tensor.float()  # as the same run's full checkpoint holds them
        assert exported["model"][name].dtype == expected.dtype, name
        assert torch.equal(exported["model"][name], expected), name
    assert len({exported["model"][name].untyped_storage().data_ptr() for name in TIED}) == 1


def test_a_read_failure_while_streaming_is_one_line_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.save(training_state(), tmp_path / "checkpoint_last.pt")

    def failing_disk(*args: Any) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(stored_tensors, "_copy_block", failing_disk)
    with pytest.raises(consolidate.ConsolidateError) as error:  # not a WriteError
        consolidate.export_consolidated(tmp_path, tmp_path / "model.pt")
    assert str(error.value) == (f"could not read {tmp_path / 'checkpoint_last.pt'}: "
                                "Input/output error (EIO)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_last.pt"]


def test_a_zip_repacked_by_another_tool_is_refused_not_exported_wrong(tmp_path: Path) -> None:
    """torch.load reads such a file exactly (by record name), but its meta load computes where
    every storage after the first lies from torch's own writer: the export held another
    record's bytes for 88 of 89 tensors of a real checkpoint."""
    original = tmp_path / "original.pt"
    torch.save(training_state(), original)
    (tmp_path / "save").mkdir()
    repacked = tmp_path / "save" / "checkpoint_last.pt"
    with zipfile.ZipFile(original) as source, \
            zipfile.ZipFile(repacked, "w", zipfile.ZIP_STORED) as target:
        for entry in source.infolist():
            target.writestr(entry, source.read(entry.filename))
    loaded = torch.load(repacked, weights_only=True)["model"]
    assert all(torch.equal(loaded[name], tensor)
               for name, tensor in training_state()["model"].items())
    with pytest.raises(consolidate.ConsolidateError, match=(
            r"checkpoint_last\.pt: its tensors are not stored where torch\.save puts them "
            r"\(re-packed by another zip tool\?\)")):
        consolidate.export_consolidated(tmp_path / "save", tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists()
    consolidate.export_consolidated(original, tmp_path / "model.pt")  # torch's own: exported
