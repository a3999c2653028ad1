"""Write a small synthetic parallel corpus and binarise it with ``fairseq-preprocess``.

The "translation" is learnable but not trivial: each source word maps to a target word
through a fixed random permutation and the sentence is reversed. No downloads.

With ``--languages`` it writes a multilingual corpus the way the NLLB recipe expects it:
NLLB-style language codes, one binarised pair per direction
(``train.eng_Latn-fra_Latn.eng_Latn.bin`` ...), one shared dictionary copied to
``dict.{lang}.txt`` for every language, and a ``langs.txt`` of one code a line (a
``--lang-dict`` file; the plugin's multilingual task also reads it as ``--langs``, as it
reads NLLB's own langs.txt, one comma-separated line). Each language renders the same
underlying sentence with its own word permutation and order.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

SPLITS = ("train", "valid", "test")


def _sentence_pair(rng: random.Random, permutation: list[int], max_len: int) -> tuple[str, str]:
    words = [rng.randrange(len(permutation)) for _ in range(rng.randint(3, max_len))]
    source = " ".join(f"w{w}" for w in words)
    target = " ".join(f"t{permutation[w]}" for w in reversed(words))
    return source, target


def write_raw(out_dir: Path, vocab: int, sizes: dict[str, int], max_len: int, seed: int) -> None:
    """Write ``{split}.src`` / ``{split}.tgt`` text files."""
    rng = random.Random(seed)
    permutation = list(range(vocab))
    rng.shuffle(permutation)
    out_dir.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        pairs = [_sentence_pair(rng, permutation, max_len) for _ in range(sizes[split])]
        (out_dir / f"{split}.src").write_text("".join(s + "\n" for s, _ in pairs))
        (out_dir / f"{split}.tgt").write_text("".join(t + "\n" for _, t in pairs))


def binarize(raw_dir: Path, bin_dir: Path, workers: int = 1) -> None:
    """Binarise with one joined dictionary, so ``--share-all-embeddings`` works."""
    prefixes = {f"--{split}pref": str(raw_dir / split) for split in ("train", "valid", "test")}
    arguments = ["--source-lang", "src", "--target-lang", "tgt", "--joined-dictionary",
                 "--destdir", str(bin_dir), "--workers", str(workers)]
    for flag, prefix in prefixes.items():
        arguments += [flag, prefix]
    _preprocess(arguments)


def make_corpus(
    out_dir: Path, vocab: int = 300, train: int = 1500, valid: int = 100, max_len: int = 12,
    seed: int = 1,
) -> Path:
    """Write and binarise a bilingual corpus under ``out_dir`` (replacing it); return the
    binarised directory."""
    shutil.rmtree(out_dir, ignore_errors=True)
    write_raw(out_dir / "raw", vocab, {"train": train, "valid": valid, "test": valid}, max_len,
              seed)
    binarize(out_dir / "raw", out_dir / "bin")
    return out_dir / "bin"


def _render(words: list[int], language: str, vocab: int) -> str:
    rng = random.Random(language)
    permutation = list(range(vocab))
    rng.shuffle(permutation)
    ordered = words if rng.random() < 0.5 else list(reversed(words))
    return " ".join(f"{language[:3]}{permutation[w]}" for w in ordered)


def write_multilingual(
    out_dir: Path, languages: list[str], vocab: int, sizes: dict[str, int], max_len: int,
    seed: int,
) -> list[tuple[str, str]]:
    """Write ``{split}.{src}-{tgt}.{lang}`` text for every direction out of the first
    language and back into it; return the directions."""
    pivot, others = languages[0], languages[1:]
    directions = [(pivot, other) for other in others] + [(other, pivot) for other in others]
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        for src, tgt in directions:
            sentences = [[rng.randrange(vocab) for _ in range(rng.randint(3, max_len))]
                         for _ in range(sizes[split])]
            for lang in (src, tgt):
                text = "".join(_render(words, lang, vocab) + "\n" for words in sentences)
                (out_dir / f"{split}.{src}-{tgt}.{lang}").write_text(text)
    return directions


# fairseq-preprocess once per argument list, in one process (fairseq imports once)
_PREPROCESS_EACH = """import json, sys
from fairseq import options
from fairseq_cli import preprocess
for arguments in json.loads(sys.argv[1]):
    preprocess.main(options.get_preprocessing_parser().parse_args(arguments))
"""


def _preprocess(*argument_lists: list[str]) -> None:
    command = [sys.executable, "-c", _PREPROCESS_EACH, json.dumps(argument_lists)]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"fairseq-preprocess failed:\n{completed.stderr[-3000:]}")


def binarize_multilingual(
    raw_dir: Path, bin_dir: Path, languages: list[str], directions: list[tuple[str, str]]
) -> None:
    """One dictionary over all languages, then every direction binarised with it."""
    everything = raw_dir / "all"
    for side in ("src", "tgt"):
        with open(f"{everything}.{side}", "w") as combined:
            for src, tgt in directions:
                combined.write((raw_dir / f"train.{src}-{tgt}.{src if side == 'src' else tgt}")
                               .read_text())
    dictionary = raw_dir / "d" / "dict.src.txt"
    make_dictionary = ["--source-lang", "src", "--target-lang", "tgt", "--joined-dictionary",
                       "--dict-only", "--trainpref", str(everything), "--destdir",
                       str(dictionary.parent)]
    binarize_directions = []
    for src, tgt in directions:
        prefix = {f"--{split}pref": str(raw_dir / f"{split}.{src}-{tgt}") for split in SPLITS}
        binarize_directions.append(
            ["--source-lang", src, "--target-lang", tgt, "--srcdict", str(dictionary),
             "--tgtdict", str(dictionary), "--destdir", str(bin_dir),
             *[item for pair in prefix.items() for item in pair]])
    _preprocess(make_dictionary, *binarize_directions)
    for lang in languages:
        shutil.copy(dictionary, bin_dir / f"dict.{lang}.txt")
    (bin_dir / "langs.txt").write_text("".join(lang + "\n" for lang in languages))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", type=Path, help="writes OUT_DIR/raw and OUT_DIR/bin")
    parser.add_argument("--vocab", type=int, default=300, help="source words (and target words)")
    parser.add_argument("--train", type=int, default=4000, help="training sentence pairs")
    parser.add_argument("--valid", type=int, default=200, help="validation and test pairs")
    parser.add_argument("--max-len", type=int, default=12, help="longest sentence in words")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--languages", help="comma-separated NLLB codes, e.g. "
                        "eng_Latn,fra_Latn,deu_Latn: a multilingual corpus (first = pivot)")
    args = parser.parse_args(argv)
    if (args.out_dir / "bin").exists():
        parser.error(f"{args.out_dir / 'bin'} exists: choose another OUT_DIR or remove it")
    sizes = {"train": args.train, "valid": args.valid, "test": args.valid}
    if args.languages:
        languages = args.languages.split(",")
        if len(languages) < 2:
            parser.error("--languages needs at least two codes")
        directions = write_multilingual(args.out_dir / "raw", languages, args.vocab, sizes,
                                        args.max_len, args.seed)
        binarize_multilingual(args.out_dir / "raw", args.out_dir / "bin", languages, directions)
        print(args.out_dir / "bin")
        return
    print(make_corpus(args.out_dir, args.vocab, args.train, args.valid, args.max_len, args.seed))


if __name__ == "__main__":
    main()
