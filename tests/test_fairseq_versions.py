"""Hooks for fairseq's nllb branch that 0.12 does not exercise, run on their own here.

The branch is not on a package index, so CI cannot install it; these tests call the
plugin's replacements directly with what the branch passes them (checked by hand on the
branch itself, see docs/nllb.md).
"""

from __future__ import annotations

from argparse import Namespace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from fairseq_shard_plugin import fairseq_integration as integration
from fairseq_shard_plugin import run_hooks
from fairseq_shard_plugin.checkpoint.sharded import SHARDED_KEY
from fairseq_shard_plugin.training.validation import check_branch_options


def never_called(*args: Any) -> Any:
    raise AssertionError("the replacement does not call the branch's own loader")


def test_the_branchs_fp16_cast_on_load_spares_fp32_masters(tmp_path: Path) -> None:
    """The branch casts every --fp16/--memory-efficient-fp16 checkpoint's model to fp16 on
    load: kept for inference loads, skipped while the trainer loads (fp32 masters) and for
    a sharded index (shard references, not tensors)."""
    load = integration._keeping_fp32_masters(never_called)
    weights = {"w": torch.randn(3, 3)}
    full = tmp_path / "full.pt"
    torch.save({"cfg": {"common": {"fp16": False, "memory_efficient_fp16": True}},
                "model": dict(weights)}, full)
    assert load(str(full))["model"]["w"].dtype == torch.float16  # inference: the branch's rule
    with run_hooks.loading_into_trainer(lambda path, state: state):
        assert torch.equal(load(str(full))["model"]["w"], weights["w"])  # exact fp32 masters
    index = tmp_path / "index.pt"
    torch.save({"cfg": {"common": {"fp16": True}}, "model": {"w": {"__shard__": "w"}},
                SHARDED_KEY: {"dir": "checkpoint_shards/u1"}}, index)
    assert load(str(index))["model"]["w"] == {"__shard__": "w"}
    fp32_run = tmp_path / "fp32.pt"
    torch.save({"cfg": {"common": {"fp16": False}}, "model": dict(weights)}, fp32_run)
    assert load(str(fp32_run))["model"]["w"].dtype == torch.float32


def test_the_plugin_given_again_as_user_dir_is_not_imported_twice() -> None:
    """The branch's import_user_module raises for a package already imported (the Hydra
    callback imports the plugin before fairseq's main does): the plugin skips itself."""
    imported: list[str] = []
    import_user_module = integration._importing_the_plugin_once(
        lambda args: imported.append(args.user_dir))
    for user_dir in ("/opt/x/fairseq_shard_plugin", "/opt/x/fairseq_shard_plugin/", None):
        assert import_user_module(Namespace(user_dir=user_dir)) is None
    import_user_module(Namespace(user_dir="/opt/x/my_models"))
    assert imported == [None, "/opt/x/my_models"]


def _save_twice_as_the_branch_does(rank: int, init_file: str, synchronize: bool) -> None:
    """One rank of a 2-rank run: fairseq's nllb branch's ``save_checkpoint`` (reduced to its
    collective steps) through the plugin's hook 5, then a collective the ranks must agree on."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    barriers = []
    stock_barrier = dist.barrier
    dist.barrier = lambda *args, **kwargs: (barriers.append(rank), stock_barrier())[1]

    class Trainer:
        writes_checkpoints_atomically = True
        should_save_checkpoint_on_current_rank = rank == 0
        state_dict_calls = 0

        def state_dict(self) -> dict:
            self.state_dict_calls += 1
            dist.all_reduce(torch.ones(1))  # the collective gather
            return {}

        def after_checkpoint_save(self) -> None:
            pass

    def branch_save(cfg: Any, trainer: Any, epoch_itr: Any, val_loss: Any) -> None:
        # the branch's checkpoint_utils.save_checkpoint: non-saving ranks return before
        # building the state (~67-68); the saving rank saves, then its barrier (~143-151)
        if cfg.no_save or not trainer.should_save_checkpoint_on_current_rank:
            return
        trainer.state_dict()
        if cfg.synchronize_checkpoints_before_copy:
            torch.distributed.barrier()

    save = integration._with_atomic_copies(branch_save)
    cfg = Namespace(no_save=False, save_dir="", synchronize_checkpoints_before_copy=synchronize)
    trainer = Trainer()
    for _ in range(2):
        save(cfg, trainer, None, None)
    step = torch.tensor([float(rank)])
    dist.all_reduce(step)  # the next training step's collective
    assert step.item() == 1.0 and trainer.state_dict_calls == 2
    assert barriers == ([rank, rank] if synchronize else [])
    dist.destroy_process_group()


@pytest.mark.parametrize("synchronize", [True, False])
def test_synchronize_checkpoints_before_copy_is_joined_by_every_rank(
    tmp_path: Path, synchronize: bool
) -> None:
    """The branch's --synchronize-checkpoints-before-copy runs a barrier on the saving rank
    only: the other ranks join it after joining the save, so no rank waits alone."""
    check_branch_options(Namespace(model=Namespace(), optimizer=Namespace(_name="adam"),
                                   checkpoint=Namespace(synchronize_checkpoints_before_copy=True)))
    torch.multiprocessing.start_processes(
        _save_twice_as_the_branch_does, args=(str(tmp_path / "init"), synchronize), nprocs=2,
        start_method="fork")


def test_the_branchs_layer_class_is_among_the_silenced_view_warnings() -> None:
    """The branch's transformer builds ``TransformerDecoderLayer`` (0.12 the ``...Base``):
    FSDP2's harmless view warning was printed by every rank of every run there."""
    import re

    from fairseq_shard_plugin.sharding.engines.fsdp2 import _HARMLESS_VIEW_OUTPUTS

    for layers in ("FSDPTransformerDecoderLayer", "FSDPTransformerEncoderLayerBase",
                   "FSDPTransformerDecoderLayer, FSDPTransformerDecoderLayer"):
        message = (f"FSDP2-wrapped module ({layers}) returned a view tensor, which can cause "
                   "backward to fail")
        assert re.match(_HARMLESS_VIEW_OUTPUTS, message), layers
    assert not re.match(_HARMLESS_VIEW_OUTPUTS, "FSDP2-wrapped module (FSDPMyLayer) returned "
                        "a view tensor")
