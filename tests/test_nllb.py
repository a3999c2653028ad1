"""Drop-in for NLLB recipes: the multilingual task, the NLLB architectures, synthetic data."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fairseq import options
from fairseq.data import Dictionary
from fairseq.tasks.translation import TranslationConfig, TranslationTask

import fairseq_shard_plugin  # noqa: F401  (registers the architectures, as --user-dir does)
from benchmarks.harness import run_training

LANGUAGES = ["eng_Latn", "fra_Latn", "deu_Latn"]
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


@pytest.fixture(scope="module")
def multilingual(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("multilingual")
    subprocess.run([sys.executable, "-m", "fairseq_shard_plugin.synthetic_corpus", str(out),
                    "--languages", ",".join(LANGUAGES), "--train", "600", "--valid", "50"],
                   check=True, capture_output=True)
    return out / "bin"


def nllb_sweep_flags(data: Path, save_dir: Path) -> list[str]:
    """The NLLB recipe's flags, at a toy model size, as users pass them to fairseq-train."""
    pairs = [f"{LANGUAGES[0]}-{o}" for o in LANGUAGES[1:]] + [f"{o}-{LANGUAGES[0]}"
                                                            for o in LANGUAGES[1:]]
    return [
        str(data), "--cpu", "--save-dir", str(save_dir), "--no-save",
        "--task", "translation_multi_simple_epoch", "--lang-pairs", ",".join(pairs),
        "--lang-dict", str(data / "langs.txt"), "--encoder-langtok", "src", "--decoder-langtok",
        "--sampling-method", "temperature", "--sampling-temperature", "1.5",
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


@pytest.mark.parametrize("precision", ["--memory-efficient-fp16", "--bf16"])
def test_nllb_sweep_trains_with_only_user_dir_and_task_changed(
    multilingual: Path, tmp_path: Path, precision: str
) -> None:
    args = nllb_sweep_flags(multilingual, tmp_path) + [precision]
    args[args.index("translation_multi_simple_epoch")] = "sharded_translation_multi_simple_epoch"
    run = run_training(args, nproc=2, plugin=True)  # adds --user-dir, --ddp-backend fully_sharded
    losses = run.series("train_inner", "loss")
    assert len(losses) == 25
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
    assert "peak_mem_gb" in run.logs["train_inner"][-1]
