"""Which stock fairseq optimizer states the sharded optimizer resumes, and the refusals.

The end-to-end resume of a stock fp32 checkpoint on 4 sharded ranks (moments equal) is in
test_checkpoints.py; these cover the layouts that cannot be produced on CPU (stock --fp16).
"""

from __future__ import annotations

import pytest
import torch

from fairseq_shard_plugin.checkpoint.errors import CheckpointLoadError
from fairseq_shard_plugin.checkpoint.stock_optimizer_state import adopt_stock_optimizer_state

SHAPES = [torch.Size([8, 4]), torch.Size([4])]


def stock_state(name: str, moments: list[torch.Size]) -> dict:
    state = {i: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(s), "exp_avg_sq":
                 torch.zeros(s)} for i, s in enumerate(moments)}
    return {"optimizer_history": [{"optimizer_name": name}],
            "last_optimizer_state": {"state": state, "param_groups": [{}], "loss_scale": 8.0}}


@pytest.mark.parametrize("saved", ["FairseqAdam", "MemoryEfficientFP16Optimizer"])
def test_per_parameter_state_is_relabelled_for_the_sharded_optimizer(saved: str) -> None:
    state = stock_state(saved, SHAPES)
    adopt_stock_optimizer_state("c.pt", state, "ShardedMasterOptimizer", "FairseqAdam", SHAPES)
    assert state["optimizer_history"][-1]["optimizer_name"] == "ShardedMasterOptimizer"


@pytest.mark.parametrize(
    ("saved", "moments", "message"),
    [
        ("FP16Optimizer", [torch.Size([36])],
         "c.pt: its FP16Optimizer state does not match this model's parameters one by one "
         "(exp_avg of parameter 0 has shape [36], the parameter [8, 4]; stock --fp16 "
         "flattens them); add --reset-optimizer"),
        ("SGD", SHAPES, "c.pt: its optimizer state was saved by SGD, this run uses "
         "FairseqAdam; add --reset-optimizer"),
        ("FairseqAdam", [*SHAPES, torch.Size([2])], "state for parameter 2 of 2"),
    ],
)
def test_state_that_does_not_fit_is_refused_in_one_line(
    saved: str, moments: list[torch.Size], message: str
) -> None:
    state = stock_state(saved, moments)
    with pytest.raises(CheckpointLoadError) as refused:
        adopt_stock_optimizer_state("c.pt", state, "ShardedMasterOptimizer", "FairseqAdam",
                                    SHAPES)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert state["optimizer_history"][-1]["optimizer_name"] == saved  # untouched


def test_the_plugins_state_goes_to_fairseqs_own_optimizer_only_where_it_fits() -> None:
    """The other way round (a plugin checkpoint resumed under legacy_ddp, end to end in
    test_resume_safety.py): fairseq's Adam over the same parameters takes it; an optimizer
    over one flat fp32 copy (stock --fp16's FP16Optimizer) is refused in one line; another
    --optimizer (SGD's momentum from Adam's moments: a KeyError at the first step) is left
    to fairseq's own "Optimizer does not match"."""
    from fairseq.optim.adam import FairseqAdam, FairseqAdamConfig
    from omegaconf import OmegaConf

    from fairseq_shard_plugin.checkpoint.stock_optimizer_state import give_to_stock_optimizer

    def adam(shapes: list[torch.Size]) -> FairseqAdam:
        parameters = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
        return FairseqAdam(OmegaConf.structured(FairseqAdamConfig(lr=[0.1], tpu=False)),
                           parameters)

    def plugins() -> dict:
        return {**stock_state("ShardedMasterOptimizer", SHAPES),
                "cfg": {"optimizer": {"_name": "adam"}}}

    state = plugins()
    give_to_stock_optimizer("c.pt", state, adam(SHAPES), "adam")
    assert state["optimizer_history"][-1]["optimizer_name"] == "FairseqAdam"
    state = plugins()
    with pytest.raises(CheckpointLoadError) as refused:
        give_to_stock_optimizer("c.pt", state, adam([torch.Size([36])]), "adam")
    assert str(refused.value) == (
        "c.pt: its optimizer state (the plugin's, one entry per parameter) does not fit "
        "fairseq's FairseqAdam (exp_avg of parameter 0 has shape [8, 4], the parameter "
        "[36]); add --reset-optimizer to start the optimizer afresh, or resume with "
        "--ddp-backend fully_sharded")
    assert state["optimizer_history"][-1]["optimizer_name"] == "ShardedMasterOptimizer"
    for other in (plugins(), stock_state("SGD", SHAPES)):  # another --optimizer; not ours
        name = other["optimizer_history"][-1]["optimizer_name"]
        give_to_stock_optimizer("c.pt", other, adam(SHAPES), "sgd")
        assert other["optimizer_history"][-1]["optimizer_name"] == name


def test_optimizer_state_for_fewer_parameters_than_the_model_is_named() -> None:
    """A parameter added at the end (an output projection untied) left every saved entry's
    shape fitting: torch's load_state_dict then failed with its own unexplained ValueError."""
    from fairseq_shard_plugin.checkpoint.stock_optimizer_state import layout_problem

    saved = {"param_groups": [{"params": [0, 1]}],
             "state": {0: {"exp_avg": torch.zeros(2, 3)}, 1: {"exp_avg": torch.zeros(3)}}}
    shapes = [torch.Size([2, 3]), torch.Size([3])]
    assert layout_problem(saved, shapes) is None
    assert layout_problem(saved, [*shapes, torch.Size([5, 3])]) == (
        "state for 2 parameters, 3 in this model")
