"""Drop-in for NLLB recipes: the multilingual task, the NLLB architectures, synthetic data."""

from __future__ import annotations

import argparse
import re
import signal
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from fairseq import options
from fairseq.data import Dictionary
from fairseq.dataclass.utils import convert_namespace_to_omegaconf, merge_with_parent
from fairseq.tasks.translation import TranslationConfig, TranslationTask
from omegaconf import OmegaConf

from fairseq_shard_plugin.tasks import register  # noqa: E402
from fairseq_shard_plugin.tasks.multilingual_config import (
    MultilingualOptionError,
    ShardedMultilingualConfig,
    task_namespace,
    task_options,
    task_parser,
)
from launching.harness import (
    PLUGIN_DIR,
    REPO,
    rank_environment,
    run_command,
    run_training,
    start_ranks,
    tool,
)

from tiny_training import ON_NLLB_BRANCH, sharded_config

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)

register()  # the plugin's tasks, criterion and architectures, as --user-dir does

VOCABULARY = 256_206


def transformer_parameters(layers: int, dim: int, ffn: int) -> int:
    """Parameters of a pre-norm transformer with all embeddings shared, from its shape."""
    attention = 4 * (dim * dim + dim)
    feed_forward = 2 * dim * ffn + ffn + dim
    encoder_layer = attention + feed_forward + 2 * 2 * dim
    decoder_layer = 2 * attention + feed_forward + 3 * 2 * dim
    return VOCABULARY * dim + layers * (encoder_layer + decoder_layer) + 2 * 2 * dim


@pytest.mark.parametrize(
    ("arch", "shape", "published"),
    [("nllb_dense_600m", (12, 1024, 4096), 615.1e6),
     ("nllb_dense_1_3b", (24, 1024, 8192), 1.37e9),
     ("nllb_dense_3_3b", (24, 2048, 8192), 3.34e9),
     # the NLLB recipe's names for the same shapes
     ("transformer_12_12", (12, 1024, 4096), 615.1e6),
     ("transformer_24_24", (24, 1024, 8192), 1.37e9),
     ("transformer_24_24_big", (24, 2048, 8192), 3.34e9)],
)
def test_nllb_architectures_have_their_published_sizes(
    corpus: Path, arch: str, shape: tuple[int, int, int], published: float
) -> None:
    dictionary = Dictionary()
    for index in range(VOCABULARY - len(dictionary)):
        dictionary.add_symbol(f"t{index}")
    args = options.parse_args_and_arch(
        options.get_training_parser(), [str(corpus), "--task", "translation", "--arch", arch])
    task = TranslationTask(TranslationConfig(), dictionary, dictionary)
    with torch.device("meta"):  # no memory: shapes only
        model = task.build_model(args)
    count = sum(p.numel() for p in model.parameters())
    assert count == transformer_parameters(*shape)
    assert abs(count - published) / published < 0.005  # published sizes are rounded
    assert model.encoder.embed_tokens is model.decoder.embed_tokens


def nllb_sweep_flags(data: Path, save_dir: Path) -> list[str]:
    """The NLLB recipe's flags, at a toy model size, as users pass them to fairseq-train."""
    pivot, *others = (data / "langs.txt").read_text().split()
    pairs = [f"{pivot}-{o}" for o in others] + [f"{o}-{pivot}" for o in others]
    return [
        str(data), "--cpu", "--save-dir", str(save_dir), "--no-save",
        "--task", "translation_multi_simple_epoch", "--lang-pairs", ",".join(pairs),
        "--lang-dict", str(data / "langs.txt"), "--encoder-langtok", "src", "--decoder-langtok",
        "--sampling-method", "temperature", "--sampling-temperature", "1",
        "--arch", "transformer", "--encoder-layers", "2", "--decoder-layers", "2",
        "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
        "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
        "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
        "--encoder-normalize-before", "--decoder-normalize-before", "--share-all-embeddings",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-6",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10", "--lr", "3e-3",
        "--max-tokens", "512", "--max-update", "25", "--seed", "2",
        "--log-format", "json", "--log-interval", "1", "--num-workers", "0",
    ]


@pytest.mark.parametrize("during", ["update", "validation"])
def test_sigterm_to_the_whole_process_group_saves_with_the_data_workers_signalled_too(
    multilingual: Path, tmp_path: Path, during: str
) -> None:
    """scancel, ``timeout`` and Slurm's time limit signal the rank's DataLoader workers too;
    torch's worker died of it, and the rank raised "DataLoader worker ... is killed by
    signal" in the middle of the step, or "exited unexpectedly" where it needed their next
    batch (validation, the rest of an update): no save, a traceback (T1 #1, T4 #1-#2,
    session 25). Here the workers get it first, the worst order: they keep serving, and the
    rank saves and stops with 128 + SIGTERM, leaving no folder of theirs in the temporary
    directory."""
    args = nllb_sweep_flags(multilingual, tmp_path / "save")
    args[args.index("translation_multi_simple_epoch")] = "sharded_translation_multi_simple_epoch"
    args[args.index("--num-workers") + 1] = "2"
    args.remove("--no-save")
    args += ["--validate-interval-updates", "3", "--data-buffer-size", "1"]
    temp = tmp_path / "temp"
    temp.mkdir()
    env = dict(rank_environment(), SIGNAL_UPDATE="3", SIGNAL="SIGTERM", WORKERS_FIRST="1",
               SIGNAL_IN=during, TMPDIR=str(temp))
    returncode, output = start_ranks(
        [sys.executable, str(REPO / "tests" / "helpers" / "signal_during_update.py"), *args,
         "--user-dir", str(PLUGIN_DIR), "--ddp-backend", "fully_sharded"], 2, env,
        timeout=300)
    assert returncode == 128 + signal.SIGTERM, output[-3000:]
    saved = re.search(r"SIGTERM: saving a checkpoint after update (\d+), then stopping", output)
    assert saved and int(saved.group(1)) in (3, 4), output[-3000:]
    assert "Traceback" not in output and "DataLoader worker" not in output, output[-3000:]
    state = torch.load(tmp_path / "save" / "checkpoint_last.pt", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == int(saved.group(1))
    # the workers' sockets lived in their rank's temporary folder, removed at its exit
    assert not list(temp.glob("pymp-*")), sorted(temp.iterdir())


def test_nllb_sweep_trains_with_only_user_dir_and_task_changed(
    multilingual: Path, tmp_path: Path
) -> None:
    """The recipe's --memory-efficient-fp16 --fp16-adam-stats (16-bit state; bf16 and the
    state's accuracy are tested with the same trainer in test_precision)."""
    args = nllb_sweep_flags(multilingual, tmp_path) + [
        "--memory-efficient-fp16", "--fp16-adam-stats"]
    args[args.index("translation_multi_simple_epoch")] = "sharded_translation_multi_simple_epoch"
    run = run_training(args, nproc=2, plugin=True)  # adds --user-dir, --ddp-backend fully_sharded
    losses = run.series("train_inner", "loss")
    assert len(losses) == 25
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
    assert "peak_mem_gb" in run.logs["train_inner"][-1]
    predicted = [line for line in run.output.splitlines() if "predicted peak: " in line]
    assert len(predicted) == 1, run.output[-3000:]
    assert {"--memory-efficient-fp16", "--fp16-adam-stats"} <= set(predicted[0].split())
    assert run.output.count("predicted host peak: ") == 1
    assert "16-bit parameters, fp16 (scaled) moments" in run.output



def test_a_resume_in_a_later_virtual_epoch_of_a_round_says_it_is_not_exact(
    multilingual: Path, tmp_path: Path
) -> None:
    """fairseq draws a round of virtual epochs' sentence order in its first epoch; a process
    resumed at the end of virtual epoch 1 drew it again for epoch 2 and trained other
    sentences, silently, where the docs advised exactly that save (T3 #1)."""
    args = nllb_sweep_flags(multilingual, tmp_path)
    args.remove("--no-save")
    args[args.index("translation_multi_simple_epoch")] = "sharded_translation_multi_simple_epoch"
    args[args.index("--max-update") + 1] = "0"
    args += ["--virtual-epoch-size", "300", "--max-epoch", "1", "--no-epoch-checkpoints"]
    first = run_training(args, nproc=1, plugin=True)
    assert "resumed in epoch" not in first.output
    args[args.index("--max-epoch") + 1] = "2"
    resumed = run_training(args, nproc=1, plugin=True)
    warned = [line for line in resumed.output.splitlines() if "resumed in epoch 2" in line]
    assert len(warned) == 1, resumed.output[-3000:]
    assert re.search(r"resumed in epoch 2, virtual epoch 2 of a round of \d+ "
                     r"\(--virtual-epoch-size\): fairseq draws", warned[0])
    assert resumed.logs["train"][-1]["epoch"] == 2


def test_a_resume_under_other_language_flags_is_refused_and_a_fine_tune_told(
    multilingual: Path, tmp_path: Path
) -> None:
    """Resumed without --decoder-langtok, a run trained on other input sentences (loss 10.2
    where the uninterrupted run had 7.8), without a word, while generation refused the same
    mismatch (T3 #2)."""
    pretrain = tmp_path / "pretrain"
    args = nllb_sweep_flags(multilingual, pretrain)
    args.remove("--no-save")
    args[args.index("translation_multi_simple_epoch")] = "sharded_translation_multi_simple_epoch"
    args[args.index("--max-update") + 1] = "3"
    run_training(args, nproc=1, plugin=True)
    last = pretrain / "checkpoint_last.pt"
    before = last.read_bytes()
    without = list(args)
    without.remove("--decoder-langtok")
    without[without.index("--max-update") + 1] = "6"
    refused = run_training(without, nproc=1, plugin=True, check=False)
    assert refused.returncode == 1
    assert refused.output.strip().splitlines()[-1] == (
        f"fairseq-shard-plugin: error: {last} was trained with --encoder-langtok src, "
        "--decoder-langtok given; this run has --encoder-langtok src, --decoder-langtok not "
        "given: give the training's language-token flags (task.encoder_langtok, "
        "task.decoder_langtok)")
    assert last.read_bytes() == before
    tuned = list(without)
    tuned[tuned.index("--save-dir") + 1] = str(tmp_path / "tuned")
    tuned += ["--finetune-from-model", str(last)]
    told = run_training(tuned, nproc=1, plugin=True)
    assert (f"{last} was trained with --encoder-langtok src, --decoder-langtok given; this run "
            "has --encoder-langtok src, --decoder-langtok not given: the fine-tune learns the "
            "new ones from the checkpoint's weights") in told.output
    # one more language: the vocabulary's shape differs too, and the list is why (a full
    # checkpoint's refusal named only the embedding's shape, T3 #4)
    extra = tmp_path / "langs_extra.txt"
    extra.write_text((multilingual / "langs.txt").read_text() + "zul_Latn\n")
    other = [*args, "--finetune-from-model", str(last)]
    other[other.index("--lang-dict") + 1] = str(extra)
    other[other.index("--save-dir") + 1] = str(tmp_path / "other")
    refused = run_training(other, nproc=1, plugin=True, check=False)
    assert refused.returncode == 1
    assert "not in the checkpoint zul_Latn" in refused.output.strip().splitlines()[-1], \
        refused.output[-2000:]

# options that exercise every kind of conversion the task's parser does: comma lists, a
# dictionary literal, a file-or-text option, choices, flags, numbers
CONVERTED_OPTIONS = ["--langtoks-specs", "main,dae", "--extra-data", "{'mined': '/data/mined'}",
                     "--virtual-epoch-size", "1000", "--lang-tok-replacing-bos-eos"]


def test_both_entry_points_give_the_multilingual_task_its_stock_options(
    multilingual: Path, tmp_path: Path
) -> None:
    """fairseq-train's flags and the equivalent Hydra keys reach the parent task as the very
    Namespace values stock ``translation_multi_simple_epoch`` gets from fairseq-train."""
    flags = nllb_sweep_flags(multilingual, tmp_path) + CONVERTED_OPTIONS

    def parsed(task: str) -> Namespace:
        flags[flags.index("--task") + 1] = task
        return options.parse_args_and_arch(options.get_training_parser(), flags)

    stock = parsed("translation_multi_simple_epoch")
    from_flags = task_namespace(convert_namespace_to_omegaconf(
        parsed("sharded_translation_multi_simple_epoch")).task)
    hydra_keys = {  # as a user writes them in a YAML config or as overrides
        "data": str(multilingual), "lang_pairs": stock.lang_pairs,
        "lang_dict": str(multilingual / "langs.txt"), "encoder_langtok": "src",
        "decoder_langtok": True, "sampling_method": "temperature", "sampling_temperature": 1.0,
        "langtoks_specs": "main,dae", "extra_data": "{'mined': '/data/mined'}",
        "virtual_epoch_size": 1000, "lang_tok_replacing_bos_eos": True,
    }
    yaml_forms = {**hydra_keys, "langtoks_specs": ["main", "dae"],
                  "extra_data": {"mined": "/data/mined"}}

    def from_hydra(task_keys: dict) -> Namespace:
        root = OmegaConf.create({"common": {"seed": 2},
                                 "dataset": {"dataset_impl": None, "train_subset": "train",
                                             "valid_subset": "valid"},
                                 "task": task_keys})
        return task_namespace(merge_with_parent(ShardedMultilingualConfig(), root.task))

    compared = [a.dest for a in task_options(task_parser()) if hasattr(stock, a.dest)]
    assert len(compared) > 30
    for route in (from_flags, from_hydra(hydra_keys), from_hydra(yaml_forms)):
        for name in compared:
            assert getattr(route, name) == getattr(stock, name), name
        assert route.seed == 2  # read by the task, though not one of its options
    assert stock.extra_data == {"mined": "/data/mined"} and stock.langtoks_specs == ["main", "dae"]


@pytest.mark.skipif(ON_NLLB_BRANCH, reason="the branch's own task options take Hydra's "
                    "+task. (the config lists fairseq 0.12's, which the branch also has)")
def test_multilingual_hydra_config_lists_every_option_of_the_task() -> None:
    listed = OmegaConf.load(REPO / "configs" / "nllb" / "corpus" / "multilingual.yaml").task
    options_of_task = {a.dest for a in task_options(task_parser())} - {"data"}
    assert options_of_task <= set(listed), options_of_task - set(listed)
    assert listed._name == "sharded_translation_multi_simple_epoch"


def test_a_bad_multilingual_option_names_its_flag_and_hydra_key() -> None:
    cfg = Namespace(**{**vars(task_namespace(Namespace(data="d", lang_pairs="a-b"))),
                       "sampling_method": "random"})
    with pytest.raises(MultilingualOptionError) as raised:
        task_namespace(cfg)
    assert str(raised.value) == (
        "sharded_translation_multi_simple_epoch: argument --sampling-method: invalid choice: "
        "'random' (choose from 'uniform', 'temperature', 'concat', 'RoundRobin') "
        "(Hydra key: task.sampling_method)")


@pytest.mark.parametrize(("key", "value", "said"), [
    ("left_pad_source", "maybe", "argument --left-pad-source (Hydra key: task.left_pad_source):"
     " 'maybe': give True or False"),  # fairseq evals it as the data loads: NameError
    ("extra_data", "notadict", "argument --extra-data (Hydra key: task.extra_data): 'notadict'"
     " is not a value of it (NameError: "),  # its converter evals it: argparse passes it on
    ("virtual_epoch_size", -5, "argument --virtual-epoch-size (Hydra key: "
     "task.virtual_epoch_size): -5: give a positive number of examples")])  # len() < 0
def test_multilingual_values_fairseq_fails_on_later_are_named(
    key: str, value: object, said: str
) -> None:
    cfg = Namespace(**{**vars(task_namespace(Namespace(data="d", lang_pairs="a-b"))),
                       key: value})
    with pytest.raises(MultilingualOptionError) as raised:
        task_namespace(cfg)
    assert str(raised.value).startswith(f"sharded_translation_multi_simple_epoch: {said}")


def test_a_sampling_temperature_of_zero_is_named_before_training(
    multilingual: Path, tmp_path: Path
) -> None:
    """fairseq raised ZeroDivisionError as the first epoch's data loaded."""
    from fairseq import tasks

    register()
    args = nllb_sweep_flags(multilingual, tmp_path)
    args[args.index("translation_multi_simple_epoch")] = "sharded_translation_multi_simple_epoch"
    args[args.index("--sampling-temperature") + 1] = "0"
    cfg = convert_namespace_to_omegaconf(
        options.parse_args_and_arch(options.get_training_parser(), args))
    with pytest.raises(MultilingualOptionError, match=r"^--sampling-temperature 0\.0: give a "
                       r"temperature above 0 \(1 samples"):
        tasks.setup_task(cfg.task)


def test_sampling_weights_without_a_direction_are_named_not_the_data(
    multilingual: Path, tmp_path: Path
) -> None:
    """A weight keyed by the direction alone (not main:SRC-TGT) was reported as missing
    training data, with advice to binarise data that is there."""
    from fairseq import tasks

    register()
    args = nllb_sweep_flags(multilingual, tmp_path)
    args[args.index("translation_multi_simple_epoch")] = "sharded_translation_multi_simple_epoch"
    pairs = args[args.index("--lang-pairs") + 1].split(",")
    weights = {pair: 1 for pair in pairs}  # fairseq's keys are main:SRC-TGT
    args[args.index("--sampling-method") + 1] = "uniform"
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(
        options.get_training_parser(), [*args, "--sampling-weights", str(weights)]))
    task = tasks.setup_task(cfg.task)
    with pytest.raises(MultilingualOptionError) as raised:
        task.load_dataset("train")
    assert str(raised.value).startswith(
        f"--sampling-weights gives no weight for 'main:{pairs[0]}' (it holds {weights!r}): ")
    assert str(raised.value).endswith(
        f"quote the whole dictionary, task.sampling_weights=\"{{'main:{pairs[0]}': 1.0}}\")")
    assert "binarise" not in str(raised.value)


def test_a_multilingual_key_left_missing_is_named() -> None:
    cfg = OmegaConf.structured(
        ShardedMultilingualConfig(seed=1, dataset_impl=None, train_subset="train",
                                  valid_subset="valid"))
    cfg.lang_pairs = "???"  # left mandatory; data is ??? by default
    with pytest.raises(MultilingualOptionError, match=r"set task\.data, task\.lang_pairs \(the"):
        task_namespace(cfg)


def test_only_a_list_of_language_codes_becomes_a_checkpoints_langs(tmp_path: Path) -> None:
    """A path in a checkpoint's config is data: a file that is not a list of language codes
    (here a key file beside the data) stays a path, so its lines never reach the config or
    the language-order error that prints the list."""
    from fairseq_shard_plugin.checkpoint.portable import languages_as_lists

    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXk=\n")
    per_line = tmp_path / "langs.txt"
    per_line.write_text("eng_Latn\nzho_Hans\n\n")
    state = {"cfg": {"task": {"langs": str(secret), "lang_dict": None},
                     "model": Namespace(langs=None, lang_dict=str(secret))}}
    upgraded = languages_as_lists(state)
    assert upgraded["cfg"]["task"] == {"langs": str(secret), "lang_dict": None}
    assert (upgraded["cfg"]["model"].langs, upgraded["cfg"]["model"].lang_dict) == (
        None, str(secret))
    state = {"cfg": {"task": {"langs": None, "lang_dict": str(per_line)}}}
    assert languages_as_lists(state)["cfg"]["task"] == {
        "langs": ["eng_Latn", "zho_Hans"], "lang_dict": None}


def test_a_checkpoint_trained_with_a_lang_dict_stores_the_list(
    multilingual: Path, tmp_path: Path
) -> None:
    """``--lang-dict`` (one code a line, as fairseq reads it) numbers the language tokens as
    ``--langs`` does; its checkpoint held only the file's path, so generation with another
    file (or order) renumbered every language token without a word."""
    codes = (multilingual / "langs.txt").read_text().split()
    args = nllb_sweep_flags(multilingual, tmp_path)
    args[args.index("translation_multi_simple_epoch")] = "sharded_translation_multi_simple_epoch"
    args[args.index("--max-update") + 1] = "2"
    args.remove("--no-save")
    run_training(args + ["--disable-validation"], nproc=1, plugin=True)
    task = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)["cfg"]["task"]
    assert (task["langs"], task["lang_dict"]) == (codes, None)  # stock refuses both at once
    reordered = tmp_path / "reordered.txt"
    reordered.write_text("".join(f"{code}\n" for code in reversed(codes)))

    def generate(lang_dict: Path, *flags: str,
                 tokens: tuple[str, ...] = ("--encoder-langtok", "src", "--decoder-langtok"),
                 task: str = "sharded_translation_multi_simple_epoch") -> str:
        generated = run_command([
            tool("fairseq-generate"), str(multilingual), "--path",
            str(tmp_path / "checkpoint_last.pt"), "--cpu", "--user-dir", str(PLUGIN_DIR),
            "--task", task, "--lang-dict", str(lang_dict),
            "--lang-pairs", "-".join(codes[:2]), "--source-lang", codes[0], "--target-lang",
            codes[1], *tokens, "--gen-subset", "valid",
            "--beam", "1", "--max-tokens", "1000", *flags])
        assert generated.returncode != 0
        assert "Traceback" not in generated.stderr, generated.stderr[-3000:]
        return generated.stderr.strip().splitlines()[-1]

    # fairseq's own task name with the plugin loaded translated differently, exit 0 (hook 13)
    for task in ("sharded_translation_multi_simple_epoch", "translation_multi_simple_epoch"):
        assert generate(reordered, task=task).startswith(
            f"fairseq-shard-plugin: error: {tmp_path / 'checkpoint_last.pt'}: the checkpoint's "
            "language tokens are numbered by its "
            "training's language list (its --langs, or the sorted languages of its "
            "--lang-pairs), and this run's list differs (the same languages in another "
            "order)")
        # without the training's language tokens it translated, differently, without a word
        assert generate(multilingual / "langs.txt", tokens=("--decoder-langtok",),
                        task=task) == (
            f"fairseq-shard-plugin: error: {tmp_path / 'checkpoint_last.pt'} was trained with "
            "--encoder-langtok src, --decoder-langtok given; this run has --encoder-langtok "
            "not given, --decoder-langtok given: give the training's language-token flags "
            "(task.encoder_langtok, task.decoder_langtok)")
    # the nllb branch's tags on a checkpoint trained without them: torch's size-mismatch
    # traceback, where the shapes say what differs
    tagged = generate(multilingual / "langs.txt", "--add-data-source-prefix-tags")
    assert tagged.startswith(
        f"fairseq-shard-plugin: error: {tmp_path / 'checkpoint_last.pt'}: does not match the "
        "model: encoder.embed_tokens.weight has shape ["), tagged
    assert tagged.endswith(
        ": 3 more dictionary entries in the model, the data-source tags of "
        "--add-data-source-prefix-tags, which the checkpoint's run did not use: remove that "
        "flag"), tagged
    # fairseq's own task with a langs FILE as --langs (the plugin's task reads it): its
    # traceback "not in the language dictionary; langs: ['.../langs.txt']" (T3 #7)
    langs_file = run_command([
        tool("fairseq-generate"), str(multilingual), "--path", str(tmp_path / "checkpoint_last.pt"),
        "--cpu", "--user-dir", str(PLUGIN_DIR), "--task", "translation_multi_simple_epoch",
        "--langs", str(multilingual / "langs.txt"), "--lang-pairs", "-".join(codes[:2]),
        "--source-lang", codes[0], "--target-lang", codes[1], "--encoder-langtok", "src",
        "--decoder-langtok", "--gen-subset", "valid", "--beam", "1", "--max-tokens", "1000"])
    assert langs_file.returncode == 1 and "Traceback" not in langs_file.stderr, \
        langs_file.stderr[-3000:]
    assert langs_file.stderr.strip().splitlines()[-1] == (
        f"fairseq-shard-plugin: error: --langs {multilingual / 'langs.txt'}: fairseq's "
        "translation_multi_simple_epoch reads --langs as comma-separated codes, not a file: "
        f"give --lang-dict {multilingual / 'langs.txt'}, the codes themselves, or --task "
        "sharded_translation_multi_simple_epoch, which reads either")


def test_a_checkpoint_trained_with_langs_file_stores_the_list(
    multilingual: Path, tmp_path: Path
) -> None:
    """``--langs langs.txt`` (the README's and NLLB's launcher's form) is saved as the list of
    codes, as stock fairseq saves it: the nllb branch's fairseq-generate refuses a path
    ("Removing langs from ensemble components not yet supported!"). Checkpoints of earlier
    versions, which hold the path, are upgraded when they load."""
    from fairseq_shard_plugin.checkpoint.portable import languages_as_lists

    args = nllb_sweep_flags(multilingual, tmp_path)
    args[args.index("--lang-dict")] = "--langs"
    args[args.index("translation_multi_simple_epoch")] = "sharded_translation_multi_simple_epoch"
    args[args.index("--max-update") + 1] = "3"
    args.remove("--no-save")
    run_training(args + ["--disable-validation"], nproc=1, plugin=True)
    codes = (multilingual / "langs.txt").read_text().replace(",", " ").split()
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    assert state["cfg"]["task"]["langs"] == codes
    assert state["cfg"]["model"]["langs"] == codes  # a plain dict
    # under another backend too (fairseq's own trainer): it stored the path, and generation
    # in another order translated differently, exit 0 (attackC #1)
    other = tmp_path / "legacy_ddp"
    stock_backend = [*args, "--user-dir", str(PLUGIN_DIR), "--ddp-backend", "legacy_ddp",
                     "--disable-validation"]
    stock_backend[stock_backend.index("--save-dir") + 1] = str(other)
    trained = run_command([tool("fairseq-train"), *stock_backend], env=rank_environment())
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert torch.load(other / "checkpoint_last.pt", weights_only=True)["cfg"]["task"][
        "langs"] == codes
    old = {"cfg": {"task": {"langs": str(multilingual / "langs.txt")},
                   "model": argparse.Namespace(langs=",".join(codes))}}
    upgraded = languages_as_lists(old)
    assert upgraded["cfg"]["task"]["langs"] == codes == upgraded["cfg"]["model"].langs
    # the list numbers the language tokens: a resume in another order would silently read
    # every language as another one
    args[args.index("--langs") + 1] = ",".join(sorted(codes))
    args[args.index("--max-update") + 1] = "4"
    resumed = run_training(args + ["--disable-validation"], nproc=1, plugin=True, check=False)
    assert resumed.returncode != 0
    assert (f"fairseq-shard-plugin: error: {tmp_path / 'checkpoint_last.pt'}: the "
            "checkpoint's language tokens are numbered by its training's language list (its "
            "--langs, or the sorted languages of its --lang-pairs), and this run's list "
            "differs (the same languages in another order): give --langs "
            f"{','.join(codes)} (the training's langs file") in resumed.output
    # a Hydra run's model config holds no langs (they are task.langs only): generation with
    # another order renumbered every language token without a word
    hydra_shaped = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    del hydra_shaped["cfg"]["model"]["langs"]
    torch.save(hydra_shaped, tmp_path / "hydra_shaped.pt")
    pair = codes[:2]
    generated = run_command([
        tool("fairseq-generate"), str(multilingual), "--path", str(tmp_path / "hydra_shaped.pt"),
        "--cpu", "--user-dir", str(PLUGIN_DIR), "--task", "sharded_translation_multi_simple_epoch",
        "--langs", ",".join(sorted(codes)), "--lang-pairs", "-".join(pair), "--source-lang",
        pair[0], "--target-lang", pair[1], "--encoder-langtok", "src", "--decoder-langtok",
        "--gen-subset", "valid", "--beam", "1", "--max-tokens", "1000"])
    assert generated.returncode != 0
    assert generated.stderr.strip().splitlines()[-1].startswith(
        f"fairseq-shard-plugin: error: {tmp_path / 'hydra_shaped.pt'}: the checkpoint's "
        "language tokens are numbered by its "
        "training's language list (its --langs, or the sorted languages of its "
            "--lang-pairs), and this run's list differs (the same languages in another "
        "order)"), generated.stderr[-3000:]
    # its export loads in stock fairseq's from_pretrained, in a process without the plugin
    # (the task is registered without a dataclass: fairseq finds it by cfg.task.task); the
    # nllb branch's hub_utils fails on its own multilingual checkpoints too (docs/nllb.md)
    if ON_NLLB_BRANCH:
        return
    from fairseq_shard_plugin.checkpoint.consolidate import export_consolidated

    export_consolidated(tmp_path / "checkpoint_last.pt", tmp_path / "export" / "model.pt")
    loaded = run_command([sys.executable, "-c", (
        "import sys; from fairseq.models.transformer import TransformerModel; "
        f"hub = TransformerModel.from_pretrained({str(tmp_path / 'export')!r}, "
        f"checkpoint_file='model.pt', data_name_or_path={str(multilingual)!r}); "
        "print(type(hub.task).__name__, ','.join(hub.task.langs), "
        "'fairseq_shard_plugin' in sys.modules)")])
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split()[-3:] == ["TranslationMultiSimpleEpochTask", ",".join(codes),
                                         "False"]


def test_multilingual_inputs_that_fairseq_misreads_are_named(tmp_path: Path) -> None:
    """Each ends in one line naming what to change: a pair that is not SRC-TGT (fairseq:
    "not enough values to unpack"), a langs file that does not exist (fairseq takes its
    path for a language code), dictionaries of different sizes (fairseq's bare assertion)."""
    from fairseq_shard_plugin.tasks.multilingual_checks import (
        check_lang_pairs,
        check_langs_files,
        dictionary_mismatch,
        language_order_problem,
    )
    from fairseq_shard_plugin.tasks.multilingual_config import MultilingualOptionError

    check_lang_pairs("eng_Latn-fra_Latn,fra_Latn-eng_Latn")
    for bad in ("eng_Latn:fra_Latn", "eng_Latn-fra_Latn-deu_Latn",
                "eng_Latn-fra_Latn, fra_Latn-eng_Latn", "eng_Latn-"):
        with pytest.raises(MultilingualOptionError, match="is not SRC-TGT"):
            check_lang_pairs(bad)
    check_langs_files("eng_Latn,fra_Latn")
    with pytest.raises(MultilingualOptionError, match="--langs moved/langs.txt: no such file"):
        check_langs_files("moved/langs.txt")
    (tmp_path / "dict.eng_Latn.txt").write_text("a 1\nb 1\n")
    (tmp_path / "dict.fra_Latn.txt").write_text("a 1\n")
    assert dictionary_mismatch(str(tmp_path), "eng_Latn-fra_Latn,fra_Latn-eng_Latn").startswith(
        f"the languages' dictionaries in {tmp_path} differ (dict.eng_Latn.txt 2 lines, "
        "dict.fra_Latn.txt 1 lines)")
    assert language_order_problem(["a", "b"], ["a", "b"]) is None
    assert language_order_problem("langs.txt", ["a", "b"]) is None  # written before lists
    assert "(missing c; not in the checkpoint d)" in language_order_problem(["a", "c"],
                                                                          ["a", "d"])


def test_only_what_the_checkpoint_itself_says_numbers_its_language_tokens(
    tmp_path: Path,
) -> None:
    """A stored --lang-dict path read from another directory (or an edited file) gave
    another list, and generation refused the training's own order while a wrong one passed
    (attackA #1); a checkpoint trained with neither option numbered its languages sorted
    from its --lang-pairs, which went unchecked (attackA #2)."""
    from fairseq_shard_plugin.checkpoint.portable import languages_numbering_the_tokens

    langs = tmp_path / "langs.txt"
    langs.write_text("deu_Latn\neng_Latn\n")

    def task(**entries: object) -> dict:
        return {"cfg": {"task": {"langs": None, "lang_dict": None, **entries}}}

    assert languages_numbering_the_tokens(task(langs=["eng_Latn", "deu_Latn"])) == [
        "eng_Latn", "deu_Latn"]
    assert languages_numbering_the_tokens(task(lang_dict=str(langs))) is None
    assert languages_numbering_the_tokens(task(langs=str(langs))) is None
    # the codes themselves, as a run under another backend stored them before
    assert languages_numbering_the_tokens(task(langs="eng_Latn,deu_Latn")) == [
        "eng_Latn", "deu_Latn"]
    assert languages_numbering_the_tokens(task(lang_pairs="fra_Latn-eng_Latn,deu_Latn-eng_Latn")
                                          ) == ["deu_Latn", "eng_Latn", "fra_Latn"]
    assert languages_numbering_the_tokens(task(lang_pairs=["eng_Latn-fra_Latn"])) == [
        "eng_Latn", "fra_Latn"]
    assert languages_numbering_the_tokens({"cfg": {"task": {"_name": "translation"}}}) is None


def test_the_bilingual_task_on_multilingual_data_says_it_trains_one_pair(
    multilingual: Path, corpus: Path
) -> None:
    """configs/nllb/tiny.yaml without +corpus=multilingual on NLLB-style data trained one of
    its directions, without language tokens, and said nothing (T3 #9)."""
    from fairseq_shard_plugin.tasks.sharded_translation import one_of_several_pairs

    told = one_of_several_pairs(sharded_config(multilingual).task)
    assert re.fullmatch(
        rf"DATA {re.escape(str(multilingual))} holds 4 language pairs \(deu_Latn-eng_Latn, "
        r"eng_Latn-deu_Latn, eng_Latn-fra_Latn, fra_Latn-eng_Latn\) and no "
        r"--source-lang/--target-lang is given: the translation task trains on "
        r"[a-z]{3}_Latn-[a-z]{3}_Latn alone; for all of them use --task "
        r"sharded_translation_multi_simple_epoch \(fairseq-hydra-train: \+corpus=multilingual\)",
        told or ""), told
    given = sharded_config(multilingual, "--source-lang", "eng_Latn", "--target-lang", "fra_Latn")
    assert one_of_several_pairs(given.task) is None
    assert one_of_several_pairs(sharded_config(corpus).task) is None  # one pair
