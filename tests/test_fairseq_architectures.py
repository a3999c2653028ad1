"""fairseq's own architectures, tasks and test data, sharded: train, resume, generate.

What fairseq's GPU acceptance test for sharding does (tests/gpu/test_binaries_gpu.py,
``_test_resume_training``), on CPU ranks and for every model family a user may bring:
train on fairseq's dummy data (its tests/utils.py fixtures) saving every 2 updates, resume
a second run from ``checkpoint_1_2.pt`` and require the same per-update losses and gradient
norms and the same final ``train_loss``/``train_ppl``/``train_gnorm``/``train_num_updates``;
then fairseq-generate (fairseq-eval-lm for the language model) on the resumed run's
checkpoint. Models are tiny: a case costs mostly process start-up.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fairseq_fixtures import create_dummy_data, preprocess_lm_data, preprocess_translation_data

from launching.harness import (
    PLUGIN_DIR,
    REPO,
    RunResult,
    in_threads,
    result_of,
    run_command,
    run_helper,
    run_training,
    tool,
)

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)

UPDATES = 6  # over two epochs of fairseq's dummy data (batches of max_tokens)
TRAIN = ["--optimizer", "adam", "--lr", "1e-3", "--max-update", str(UPDATES),
         "--save-interval-updates", "2", "--seed", "1",
         "--log-format", "json", "--log-interval", "1", "--num-workers", "0", "--cpu"]
LANGS = ["--source-lang", "in", "--target-lang", "out"]


def small(*layers: str, dim: int = 16, heads: bool = True) -> list[str]:
    """Embedding/ffn sizes (and attention heads) for ``layers`` ("encoder", "decoder")."""
    args = []
    for side in layers:
        args += [f"--{side}-embed-dim", str(dim), f"--{side}-ffn-embed-dim", str(2 * dim)]
        args += [f"--{side}-attention-heads", "2"] if heads else []
    return args


@dataclass(frozen=True)
class Case:
    arch: str
    model: tuple[str, ...]  # the arch's size overrides and options
    task: str = "translation"
    ranks: int = 2
    extra: tuple[str, ...] = ()  # criterion, precision, checkpoint format, ...
    max_tokens: int = 500  # small enough for 3+ updates per epoch: update 2 is mid-epoch
    layer_units: int = 4  # what the wrap policy makes units of, besides the vocabulary


TRANSFORMER = ("--encoder-layers", "2", "--decoder-layers", "2",
               *small("encoder", "decoder"))
CASES = [
    # the plugin's task name, fp16 compute and the sharded checkpoint format
    Case("transformer", (*TRANSFORMER, "--share-all-embeddings"), task="sharded_translation",
         extra=("--fp16", "--checkpoint-format", "sharded")),
    Case("transformer_lm", ("--decoder-layers", "2", *small("decoder"),
                            "--tokens-per-sample", "64"), task="language_modeling",
         max_tokens=128, layer_units=2),
    Case("bart_base", ("--encoder-layers", "1", "--decoder-layers", "1",
                       *small("encoder", "decoder")), layer_units=2),
    # weight-normed convolutions: weight_g of shape [1, 1, d], an empty shard on ranks 1-2
    Case("fconv_iwslt_de_en", ("--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
                               "--decoder-out-embed-dim", "32",
                               "--encoder-layers", "[(32, 3)] * 2",
                               "--decoder-layers", "[(32, 3)] * 2"), ranks=3,
         max_tokens=300, layer_units=6),  # each convolution and decoder attention layer
    Case("lstm", ("--encoder-layers", "2", "--decoder-layers", "2",
                  "--encoder-embed-dim", "16", "--encoder-hidden-size", "16",
                  "--decoder-embed-dim", "16", "--decoder-hidden-size", "16",
                  "--decoder-out-embed-dim", "16", "--share-all-embeddings"),
         # the encoder's nn.LSTM (decoder cells run per time step: root); the shared
         # embedding, whose weight the decoder reads outside the module (kept gathered);
         # and a configuration written for a cluster, run on one node
         layer_units=1, task="sharded_translation", extra=("--shard-strategy", "hybrid")),
    # repeated blocks (not transformer layers: sharded after the build) two per unit
    Case("lightconv_iwslt_de_en", ("--encoder-layers", "2", "--decoder-layers", "2",
                                   *small("encoder", "decoder"),
                                   "--encoder-conv-dim", "16", "--decoder-conv-dim", "16",
                                   "--encoder-kernel-size-list", "[3, 3]",
                                   "--decoder-kernel-size-list", "[3, 3]",
                                   "--share-decoder-input-output-embed"),
         task="sharded_translation", extra=("--layers-per-unit", "2"), layer_units=2),
    Case("transformer_align", (*TRANSFORMER, "--alignment-layer", "1"),
         extra=("--load-alignments", "--criterion",
                "label_smoothed_cross_entropy_with_alignment")),
]


@pytest.fixture(scope="module")
def fairseq_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """fairseq's dummy translation data (joined dictionary, with alignments) and its
    language-model data, made by fairseq's own fixtures."""
    random.seed(1)
    torch.manual_seed(1)
    translation = tmp_path_factory.mktemp("fairseq_translation")
    create_dummy_data(str(translation), alignment=True)
    preprocess_translation_data(str(translation), ["--joined-dictionary", "--align-suffix",
                                                   "align"])
    lm = tmp_path_factory.mktemp("fairseq_lm")
    create_dummy_data(str(lm))
    preprocess_lm_data(str(lm))
    return {"translation": translation, "lm": lm}


def train(case: Case, data: Path, save_dir: Path, *flags: str) -> RunResult:
    args = [str(data), "--task", case.task, "--arch", case.arch, *case.model, *case.extra,
            *(LANGS if case.task != "language_modeling" else []), *TRAIN,
            "--max-tokens", str(case.max_tokens),
            "--save-dir", str(save_dir), *flags]
    return run_training(args, nproc=case.ranks, plugin=True, timeout=300)


def per_update(run: RunResult, key: str) -> dict[int, str]:
    return {int(entry["num_updates"]): entry[key] for entry in run.logs["train_inner"]}


def evaluate(case: Case, data: Path, checkpoint: Path) -> str:
    """fairseq-generate (fairseq-eval-lm for a language model) on ``checkpoint``."""
    common = [str(data), "--path", str(checkpoint), "--user-dir", str(PLUGIN_DIR), "--cpu",
              "--task", case.task, "--num-workers", "0"]
    if case.task == "language_modeling":
        command = [tool("fairseq-eval-lm"), *common, "--tokens-per-sample", "64",
                   "--max-tokens", "500", "--gen-subset", "valid"]
    else:
        command = [tool("fairseq-generate"), *common, *LANGS, "--beam", "3",
                   "--batch-size", "64", "--max-len-b", "5", "--gen-subset", "valid",
                   *(["--print-alignment"] if case.arch == "transformer_align" else [])]
    done = run_command(command)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout + done.stderr


@dataclass
class CaseRuns:
    uninterrupted: RunResult
    resumed: RunResult
    evaluation: str  # fairseq-generate's or fairseq-eval-lm's output on the resumed run


def run_case(case: Case, data: Path, work: Path) -> CaseRuns:
    """Train uninterrupted, resume from ``checkpoint_1_2.pt``, evaluate the result."""
    uninterrupted = train(case, data, work / "uninterrupted")
    restore = work / "uninterrupted" / "checkpoint_1_2.pt"  # mid-epoch 1
    assert restore.is_file(), restore  # fairseq would start afresh without a word
    resumed = train(case, data, work / "resumed", "--restore-file", str(restore))
    return CaseRuns(uninterrupted, resumed,
                    evaluate(case, data, work / "resumed" / "checkpoint_last.pt"))


@pytest.fixture(scope="module")
def launches(fairseq_data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, object]:
    """Every case of the matrix and every shape load, three at a time: mostly process
    start-up, which overlaps on 2 cores; nothing compared depends on timing."""
    def case_job(case: Case) -> Callable[[], CaseRuns]:
        data = fairseq_data["lm" if case.task == "language_modeling" else "translation"]
        return lambda: run_case(case, data, tmp_path_factory.mktemp(case.arch))

    def shape_job(ranks: int) -> Callable[[], dict]:
        return lambda: load_any_shape(ranks, tmp_path_factory.mktemp(f"shapes_{ranks}"))

    bart = next(case for case in CASES if case.arch == "bart_base")
    return in_threads({**{case.arch: case_job(case) for case in CASES},
                       **{f"shapes_{ranks}": shape_job(ranks) for ranks in (2, 3, 4)},
                       "bart_initial": lambda: initial_weights(
                           bart, fairseq_data["translation"],
                           tmp_path_factory.mktemp("bart_initial"))},
                      workers=3)


@pytest.mark.parametrize("case", CASES, ids=[case.arch for case in CASES])
def test_resume_from_an_interval_checkpoint_matches_the_uninterrupted_run(
    case: Case, launches: dict[str, object]
) -> None:
    runs = result_of(launches, case.arch)
    assert isinstance(runs, CaseRuns)
    uninterrupted, resumed = runs.uninterrupted, runs.resumed
    plan = re.findall(r"sharded over \d ranks with fsdp2: (\d+) layer units", uninterrupted.output)
    assert plan == [str(case.layer_units)], plan  # logged by rank 0
    if "hybrid" in case.extra:  # one line (rank 0), and the run trains
        assert uninterrupted.output.count("so this run shards fully over them") == 1
    assert "train_num_updates" in uninterrupted.logs["train"][-1]

    first = uninterrupted.logs["train_inner"]
    assert [int(e["num_updates"]) for e in first] == list(range(1, UPDATES + 1))
    assert min(per_update(resumed, "num_updates")) == 3
    for key in ("loss", "gnorm"):
        expected = {u: v for u, v in per_update(uninterrupted, key).items() if u > 2}
        assert per_update(resumed, key) == expected, key
    for key in ("train_loss", "train_ppl", "train_gnorm", "train_num_updates"):
        assert resumed.logs["train"][-1][key] == uninterrupted.logs["train"][-1][key], key

    if case.task == "language_modeling":
        assert re.search(r"Loss \(base 2\): \d+\.\d+, Perplexity: \d+\.\d+", runs.evaluation)
    else:
        translated = re.search(r"Translated (\d+) sentences", runs.evaluation)
        hypotheses = re.findall(r"^H-\d+\t", runs.evaluation, re.MULTILINE)
        assert translated and len(hypotheses) == int(translated.group(1)) > 90, (
            runs.evaluation[-2000:])


def initial_weights(case: Case, data: Path, save_dir: Path) -> dict[str, torch.Tensor]:
    """The model's weights after one update at learning rate 0: those it was built with."""
    train(case, data, save_dir, "--max-update", "1", "--optimizer", "sgd", "--lr", "0")
    return torch.load(save_dir / "checkpoint_last.pt", weights_only=True)["model"]


def test_a_model_that_initialises_its_sharded_layers_again_gets_stocks_weights(
    fairseq_data: dict[str, Path], launches: dict[str, object]
) -> None:
    """BART draws every weight again once its layers exist (``init_bert_params``), when
    they are already sharded: each rank drew the same numbers for its rows (a weight's
    halves were equal on 2 ranks) and every later draw moved. The 2-rank run's weights
    after an update at learning rate 0 are those of fairseq's build in one process."""
    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    saved = result_of(launches, "bart_initial")
    assert isinstance(saved, dict)
    bart = next(case for case in CASES if case.arch == "bart_base")
    parser = options.get_training_parser()
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(parser, [
        str(fairseq_data["translation"]), "--arch", bart.arch, *bart.model, *LANGS,
        *TRAIN, "--max-tokens", "500", "--task", bart.task]))
    utils.set_torch_seed(cfg.common.seed)  # as fairseq_cli.train does before it builds
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    different = [name for name, tensor in model.state_dict().items()
                 if name in saved and not torch.equal(saved[name], tensor)]
    assert different == [] and len(saved) > 20, different


def load_any_shape(ranks: int, work: Path) -> dict:
    run_helper(REPO / "tests" / "helpers" / "load_any_shape.py", str(work / "report.json"),
               str(work), nproc=ranks)
    return json.loads((work / "report.json").read_text())


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_full_and_sharded_state_load_into_shards_of_any_shape(
    ranks: int, launches: dict[str, object]
) -> None:
    """dim 0 of 1, below the number of ranks, uneven, 1-D: some ranks hold empty shards."""
    report = result_of(launches, f"shapes_{ranks}")
    assert isinstance(report, dict)
    assert report["local_numel"]["dim0_of_1"] == 8  # rank 0 holds it all, the others none
    assert len(report["full"]) == len(report["sharded"]) == 6
    assert all(report["full"].values()), report["full"]
    assert all(report["sharded"].values()), report["sharded"]


def test_a_scalar_parameter_is_named_before_anything_is_sharded() -> None:
    from fairseq_shard_plugin.errors import ShardingConfigError
    from fairseq_shard_plugin.sharding.engines.fsdp2 import refuse_scalar_parameters

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    refuse_scalar_parameters(model)  # vectors and matrices are fine
    model[0].register_parameter("gate", torch.nn.Parameter(torch.tensor(0.5)))
    with pytest.raises(ShardingConfigError, match=r"^parameter 0\.gate is a scalar \(0-dim\)"):
        refuse_scalar_parameters(model)
