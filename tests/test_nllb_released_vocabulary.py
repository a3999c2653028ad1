"""Fine-tuning a released NLLB-200 checkpoint on fairseq 0.12: the multilingual task rebuilds
the released vocabulary (dictionary, then one language token per language of NLLB's
langs.txt in its order, then the nllb branch's three data-source tags), so a checkpoint in
that layout passes ``--finetune-from-model``'s shape check. No download: the checkpoint is
built here at a toy size in exactly that layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf, merge_with_parent
from omegaconf import OmegaConf

from fairseq_shard_plugin.tasks import register
from fairseq_shard_plugin.tasks.multilingual_config import (
    ShardedMultilingualConfig,
    fairseq_adds_prefix_tags,
)
from fairseq_shard_plugin.tasks.sharded_multilingual import (
    ShardedTranslationMultiSimpleEpochTask,
)
from launching.harness import run_training

from tiny_training import ON_NLLB_BRANCH

register()  # the plugin's tasks, as --user-dir does

# NLLB's langs.txt is one comma-separated line (examples/nllb/modeling/scripts/flores200/
# langs.txt on fairseq's nllb branch: 202 codes); languages without data come first, between
# and last, as in the released list
LANGUAGES = ["ace_Arab", "deu_Latn", "eng_Latn", "fra_Latn", "zul_Latn"]
# the nllb branch's DATA_SOURCE_PREFIX_TAGS, in its order
TAGS = ["<MINED_DATA>", "<MMT_BT_DATA>", "<SMT_BT_DATA>"]
PAIRS = "eng_Latn-fra_Latn,fra_Latn-eng_Latn"
TINY_TRANSFORMER = [
    "--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--encoder-normalize-before", "--decoder-normalize-before", "--share-all-embeddings",
]


def released_recipe_flags(data: Path, languages: str, *extra: str) -> list[str]:
    """The NLLB recipe's task flags (examples/nllb/modeling/train/train_script.py), with the
    plugin's task, at a toy model size."""
    return [
        str(data), "--cpu", "--task", "sharded_translation_multi_simple_epoch",
        "--langs", languages, "--lang-pairs", PAIRS, "--encoder-langtok", "src",
        "--decoder-langtok", "--sampling-method", "temperature", "--sampling-temperature", "1.5",
        *TINY_TRANSFORMER, *extra,
    ]


def nllb_langs_file(directory: Path) -> Path:
    path = directory / "langs.txt"
    path.write_text(",".join(LANGUAGES) + "\n")
    return path


def setup(flags: list[str]) -> tuple[object, object]:
    cfg = convert_namespace_to_omegaconf(
        options.parse_args_and_arch(options.get_training_parser(), flags))
    return cfg, tasks.setup_task(cfg.task)


def dictionary_words(data: Path) -> int:
    return len((data / "dict.eng_Latn.txt").read_text().splitlines())


@pytest.mark.skipif(ON_NLLB_BRANCH, reason="the nllb branch has the option itself")
def test_fairseq_0_12_lacks_the_flag_so_the_plugin_adds_it() -> None:
    assert not fairseq_adds_prefix_tags()  # CI's fairseq: the tests below use the plugin's


def test_the_task_rebuilds_the_released_vocabulary_layout(
    multilingual: Path, tmp_path: Path
) -> None:
    words = dictionary_words(multilingual)
    _, task = setup(released_recipe_flags(multilingual, str(nllb_langs_file(tmp_path)),
                                          "--add-data-source-prefix-tags"))
    dictionary = task.source_dictionary
    assert task.target_dictionary.symbols == dictionary.symbols
    assert task.langs == LANGUAGES
    # fairseq's 4 specials, the dictionary file, the language tokens, the tags
    assert len(dictionary) == 4 + words + len(LANGUAGES) + len(TAGS)
    assert dictionary.index("__ace_Arab__") == 4 + words
    assert dictionary.index("__zul_Latn__") == 4 + words + len(LANGUAGES) - 1
    assert [dictionary.index(f"__{lang}__") for lang in LANGUAGES] == list(
        range(4 + words, 4 + words + len(LANGUAGES)))
    for offset, tag in enumerate(TAGS):
        assert dictionary.index(tag) == 4 + words + len(LANGUAGES) + offset
    assert dictionary.index(TAGS[-1]) == len(dictionary) - 1

    _, without_tags = setup(released_recipe_flags(multilingual, str(tmp_path / "langs.txt")))
    assert len(without_tags.source_dictionary) == 4 + words + len(LANGUAGES)

    # the same from Hydra keys (configs/nllb/corpus/multilingual.yaml's names)
    root = OmegaConf.create({
        "common": {"seed": 2},
        "dataset": {"dataset_impl": None, "train_subset": "train", "valid_subset": "valid"},
        "task": {"data": str(multilingual), "langs": str(tmp_path / "langs.txt"),
                 "lang_pairs": PAIRS, "add_data_source_prefix_tags": True,
                 "encoder_langtok": "src", "decoder_langtok": True}})
    from_hydra = ShardedTranslationMultiSimpleEpochTask.setup_task(
        merge_with_parent(ShardedMultilingualConfig(), root.task))
    assert from_hydra.source_dictionary.symbols == dictionary.symbols


@pytest.mark.parametrize("form", ["comma list", "one code a line", "lang-dict with NLLB's line"])
def test_every_form_of_the_language_list_gives_the_same_order(
    multilingual: Path, tmp_path: Path, form: str
) -> None:
    if form == "comma list":
        flags = released_recipe_flags(multilingual, ",".join(LANGUAGES))
    elif form == "one code a line":
        (tmp_path / "lines.txt").write_text("".join(f"{lang}\n" for lang in LANGUAGES))
        flags = released_recipe_flags(multilingual, str(tmp_path / "lines.txt"))
    else:
        flags = released_recipe_flags(multilingual, "x")
        at = flags.index("--langs")
        flags[at:at + 2] = ["--lang-dict", str(nllb_langs_file(tmp_path))]
    _, task = setup(flags)
    assert task.langs == LANGUAGES
    first = 4 + dictionary_words(multilingual)
    assert task.source_dictionary.index("__ace_Arab__") == first
    assert task.source_dictionary.index("__zul_Latn__") == first + len(LANGUAGES) - 1


@pytest.mark.e2e
def test_finetuning_from_a_checkpoint_in_the_released_layout(
    multilingual: Path, tmp_path: Path
) -> None:
    """A checkpoint whose embedding has the released layout's rows (written as fairseq
    writes checkpoints) loads with --finetune-from-model on 2 ranks and trains an update;
    without the tags flag the same checkpoint does not fit the model."""
    langs = str(nllb_langs_file(tmp_path))
    task_flags = released_recipe_flags(multilingual, langs, "--add-data-source-prefix-tags")
    cfg, task = setup(task_flags)
    model = task.build_model(cfg.model)
    rows = 4 + dictionary_words(multilingual) + len(LANGUAGES) + len(TAGS)
    assert model.encoder.embed_tokens.weight.shape[0] == rows == len(task.source_dictionary)
    released = tmp_path / "released.pt"
    torch.save({
        "args": None,
        "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        "model": model.state_dict(),
        "criterion": {},
        "optimizer_history": [{"criterion_name": "LabelSmoothedCrossEntropyCriterion",
                               "optimizer_name": "FairseqAdam",
                               "lr_scheduler_state": {"best": None}, "num_updates": 0}],
        "task_state": {},
        "extra_state": {"train_iterator": {"epoch": 1}},
        "last_optimizer_state": None,
    }, released)

    no_tags_cfg, no_tags_task = setup(released_recipe_flags(multilingual, langs))
    with pytest.raises(RuntimeError, match="size mismatch"):
        no_tags_task.build_model(no_tags_cfg.model).load_state_dict(model.state_dict())

    run = run_training(task_flags + [
        "--finetune-from-model", str(released), "--save-dir", str(tmp_path / "ft"),
        "--no-save", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--optimizer", "adam", "--lr", "1e-4", "--max-tokens", "256", "--max-update", "1",
        "--log-format", "json", "--log-interval", "1", "--num-workers", "0", "--seed", "2",
    ], nproc=2, plugin=True, timeout=120)
    assert f"loaded checkpoint {released}" in run.output.lower(), run.output[-3000:]
    assert len(run.series("train_inner", "loss")) == 1, run.output[-3000:]
