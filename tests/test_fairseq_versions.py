"""Hooks for fairseq's nllb branch that 0.12 does not exercise, run on their own here.

The branch is not on a package index, so CI cannot install it; these tests call the
plugin's replacements directly with what the branch passes them (checked by hand on the
branch itself, see docs/nllb.md).
"""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path
from typing import Any

import torch

from fairseq_shard_plugin import fairseq_integration as integration
from fairseq_shard_plugin.checkpoint.sharded import SHARDED_KEY
from fairseq_shard_plugin.training import run_hooks


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
