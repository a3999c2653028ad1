"""The wrap policy picks units by layer class on real fairseq models of several families."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from fairseq import options, tasks

from fairseq_shard_plugin.sharding.settings import ReshardPolicy
from fairseq_shard_plugin.sharding.wrap_policy import (
    LAYER_CLASSES,
    build_plan,
    describe_plan,
    is_linear_layer,
)
from fairseq_shard_plugin.tasks import register  # noqa: E402
from launching.harness import run_command

register()  # the plugin's tasks, criterion and architectures, as --user-dir does

REPO = Path(__file__).resolve().parents[1]

SMALL = [
    "--encoder-layers", "2", "--decoder-layers", "3",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
]
LM_SMALL = ["--decoder-layers", "3", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim",
            "64", "--decoder-attention-heads", "2", "--tokens-per-sample", "64"]


def build_model(data: Path, task: str, arch: str, extra: list[str]) -> nn.Module:
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(data), "--task", task, "--arch", arch, *extra])
    return tasks.setup_task(args).build_model(args)


def unit_names(model: nn.Module) -> list[str]:
    return [unit.name for unit in build_plan(model).units]


LAYERS = ["encoder.layers.0", "encoder.layers.1",
          "decoder.layers.0", "decoder.layers.1", "decoder.layers.2"]


@pytest.mark.parametrize("arch", ["transformer", "bart_base", "mbart_large"])
def test_encoder_decoder_layers_and_tied_vocabulary(corpus: Path, arch: str) -> None:
    model = build_model(corpus, "translation", arch, [*SMALL, "--share-all-embeddings"])
    assert unit_names(model) == [*LAYERS, "encoder.embed_tokens+decoder.output_projection"]
    vocabulary = build_plan(model).units[-1]
    assert model.decoder.embed_tokens in vocabulary.modules  # the same module as the encoder's


class LinearOfAnotherClass(nn.Module):
    """Like the nllb branch's ``fairseq.modules.linear.Linear``: not an ``nn.Linear``."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


def test_a_tied_output_projection_of_another_class_joins_the_vocabulary_unit(
    corpus: Path,
) -> None:
    model = build_model(corpus, "translation", "transformer", [*SMALL, "--share-all-embeddings"])
    model.decoder.output_projection = LinearOfAnotherClass(model.decoder.embed_tokens.weight)
    assert unit_names(model) == [*LAYERS, "encoder.embed_tokens+decoder.output_projection"]
    assert is_linear_layer(model.decoder.output_projection)
    assert not is_linear_layer(model.decoder.embed_tokens)  # 2-D weight, but an embedding
    assert not is_linear_layer(model.decoder.layers[0])  # a module with children


def test_a_module_holding_the_embeddings_weight_under_another_name_joins_its_unit(
    corpus: Path,
) -> None:
    """fconv's --share-input-output-embed ties decoder.fc3 to decoder.embed_tokens: fc3
    stayed in the root, and FSDP refused a parameter shared by two units (a traceback)."""
    model = build_model(corpus, "translation", "fconv_iwslt_de_en", [
        "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--decoder-out-embed-dim", "32", "--encoder-layers", "[(32, 3)] * 2",
        "--decoder-layers", "[(32, 3)] * 2", "--share-input-output-embed"])
    vocabulary = [unit for unit in build_plan(model).units if unit.vocabulary]
    assert [unit.name for unit in vocabulary] == [
        "encoder.embed_tokens", "decoder.embed_tokens+decoder.fc3"]
    assert model.decoder.fc3 in vocabulary[1].modules


def test_untied_embeddings_are_separate_units(corpus: Path) -> None:
    model = build_model(corpus, "translation", "transformer", SMALL)
    assert unit_names(model) == [
        *LAYERS, "encoder.embed_tokens", "decoder.embed_tokens", "decoder.output_projection"
    ]


def test_decoder_only_language_model(corpus: Path, tmp_path: Path) -> None:
    shutil.copytree(corpus, tmp_path / "lm")
    shutil.copy(tmp_path / "lm" / "dict.src.txt", tmp_path / "lm" / "dict.txt")
    model = build_model(tmp_path / "lm", "language_modeling", "transformer_lm",
                        [*LM_SMALL, "--share-decoder-input-output-embed"])
    assert unit_names(model) == [
        "decoder.layers.0", "decoder.layers.1", "decoder.layers.2",
        "decoder.embed_tokens+decoder.output_projection",
    ]


def test_adaptive_input_and_softmax_are_refused_by_name(corpus: Path, tmp_path: Path) -> None:
    """Their bands run only for the tokens a batch holds: with the bands as units, ranks
    whose batch missed a band skipped its all-gather (gloo aborted or hung)."""
    from fairseq_shard_plugin.errors import ShardingConfigError
    from fairseq_shard_plugin.sharding.wrap_policy import refuse_adaptive_modules

    shutil.copytree(corpus, tmp_path / "lm")
    shutil.copy(tmp_path / "lm" / "dict.src.txt", tmp_path / "lm" / "dict.txt")
    refuse_adaptive_modules(build_model(tmp_path / "lm", "language_modeling",
                                        "transformer_lm", LM_SMALL))  # none: nothing to say
    for flags, named in (
            (["--adaptive-input", "--adaptive-input-cutoff", "20", "--adaptive-input-factor",
              "2"], "--adaptive-input (decoder.embed_tokens)"),
            (["--adaptive-softmax-cutoff", "20"], "--adaptive-softmax-cutoff "
                                                  "(decoder.adaptive_softmax)")):
        model = build_model(tmp_path / "lm", "language_modeling", "transformer_lm",
                            [*LM_SMALL, *flags])
        with pytest.raises(ShardingConfigError, match=re.escape(named)):
            refuse_adaptive_modules(model)


def test_every_layer_is_a_unit_whatever_min_params_to_wrap_says(corpus: Path) -> None:
    model = build_model(corpus, "translation", "transformer",
                        [*SMALL, "--min-params-to-wrap", "100000000"])
    layers = [m for m in model.modules() if isinstance(m, LAYER_CLASSES)]
    plan = build_plan(model)
    assert [unit.modules[0] for unit in plan.units[: len(layers)]] == layers
    assert all(unit.reshard_after_forward for unit in plan.units)


def test_layers_per_unit_groups_consecutive_layers_of_one_stack(corpus: Path) -> None:
    """2 encoder and 3 decoder layers, 2 per unit: a stack's rest is a unit of its own, and
    no unit spans the encoder and the decoder."""
    model = build_model(corpus, "translation", "transformer", [*SMALL, "--share-all-embeddings"])
    plan = build_plan(model, layers_per_unit=2)
    assert [unit.name for unit in plan.units] == [
        "encoder.layers.0-1", "decoder.layers.0-1", "decoder.layers.2",
        "encoder.embed_tokens+decoder.output_projection"]
    decoder = list(model.decoder.layers)
    assert [unit.modules for unit in plan.units[1:3]] == [tuple(decoder[:2]), (decoder[2],)]
    assert [u.name for u in build_plan(model, layers_per_unit=8).units][:2] == [
        "encoder.layers.0-1", "decoder.layers.0-2"]
    assert build_plan(model, layers_per_unit=1).units == build_plan(model).units


def test_layers_per_unit_groups_the_blocks_of_other_architectures(corpus: Path) -> None:
    model = build_model(corpus, "translation", "fconv_iwslt_de_en", [
        "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--decoder-out-embed-dim", "32", "--encoder-layers", "[(32, 3)] * 3",
        "--decoder-layers", "[(32, 3)] * 2"])
    names = [unit.name for unit in build_plan(model, layers_per_unit=2).units]
    assert names[:2] == ["encoder.convolutions.0-1", "encoder.convolutions.2"], names
    assert all(len(u.modules) <= 2 for u in build_plan(model, layers_per_unit=2).units
               if not u.vocabulary)


def test_root_reshards_unless_asked_to_keep_it_gathered(corpus: Path) -> None:
    model = build_model(corpus, "translation", "bart_base", SMALL)
    assert build_plan(model).root.reshard_after_forward
    assert not build_plan(model, ReshardPolicy(root=False)).root.reshard_after_forward


def test_only_the_vocabulary_unit_stays_gathered_when_asked(corpus: Path) -> None:
    model = build_model(corpus, "translation", "transformer", SMALL)
    units = build_plan(model, ReshardPolicy(vocabulary=False)).units
    assert [u.reshard_after_forward for u in units] == [not u.vocabulary for u in units]
    assert units[-1].vocabulary and build_plan(model).root.reshard_after_forward


def test_every_unit_stays_gathered_without_reshard_after_forward(corpus: Path) -> None:
    model = build_model(corpus, "translation", "transformer", SMALL)
    plan = build_plan(model, ReshardPolicy.from_flags(False, False, no_reshard_after_forward=True))
    assert len(plan.units) == len(build_plan(model).units)
    assert not any(u.reshard_after_forward for u in (*plan.units, plan.root))


def test_root_unit_only_reproduces_stock_plan(corpus: Path) -> None:
    model = build_model(corpus, "translation", "transformer", SMALL)
    plan = build_plan(model, ReshardPolicy(root=False), root_unit_only=True)
    assert plan.units == () and plan.root.modules == (model,)
    assert not plan.root.reshard_after_forward
    # learned positions and final norms stay in the root
    assert not any("embed_positions" in name for name in unit_names(model))
    # the log says why there are no layer units (it said none were found)
    assert describe_plan(plan, root_unit_only=True).endswith(
        "(--root-unit-only: the whole model is sharded as one unit)")


@pytest.mark.e2e
def test_only_the_vocabulary_unit_reduces_in_16_bit_when_asked(corpus: Path) -> None:
    command = [sys.executable, str(REPO / "tests" / "helpers" / "vocabulary_reduce_policy.py"),
               str(corpus), "--task", "sharded_translation", "--arch", "transformer",
               "--share-all-embeddings", *SMALL, "--bf16", "--cpu",
               "--ddp-backend", "fully_sharded", "--optimizer", "adam", "--lr", "1e-3",
               "--reduce-vocabulary-in-16-bit"]
    completed = run_command(command)
    assert completed.returncode == 0, completed.stderr[-3000:]
    reduce_dtypes = json.loads(completed.stdout.strip().splitlines()[-1])
    vocabulary = [name for name in reduce_dtypes if "embed_tokens" in name]
    assert len(vocabulary) == 1 and reduce_dtypes[vocabulary[0]] == "torch.bfloat16"
    assert {d for n, d in reduce_dtypes.items() if n not in vocabulary} == {"torch.float32"}


def test_layers_sharded_in_other_groups_than_the_plan_are_refused(tmp_path: Path) -> None:
    """The check between hook 1's grouping (while fairseq builds the model) and the plan's:
    a unit is taken as sharded only when all its modules form one FSDP2 unit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fairseq_shard_plugin.sharding.engines.fsdp2 import sharded_together
    from fairseq_shard_plugin.sharding.wrap_policy import ShardUnit

    if not dist.is_initialized():  # a one-rank group, as test_sharded_checkpoint_security's
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                                rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    a, b, c, d, e = (nn.Linear(2, 2) for _ in range(5))
    fully_shard(a, mesh=mesh)
    fully_shard(b, mesh=mesh)
    fully_shard([c, d], mesh=mesh)
    assert sharded_together(ShardUnit("c-d", (c, d)))
    assert sharded_together(ShardUnit("a", (a,)))
    assert not sharded_together(ShardUnit("e", (e,)))
    for modules in ((a, b), (c,), (c, e)):
        with pytest.raises(RuntimeError, match="grouped otherwise than the wrap policy's"):
            sharded_together(ShardUnit("unit", modules))
