"""Write a small synthetic parallel corpus and binarise it with ``fairseq-preprocess``.

The "translation" is learnable but not trivial: each source word maps to a target word
through a fixed random permutation and the sentence is reversed. No downloads.
"""

from __future__ import annotations

import argparse
import random
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
    command = [sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", "src",
               "--target-lang", "tgt", "--joined-dictionary", "--destdir", str(bin_dir),
               "--workers", str(workers)]
    for flag, prefix in prefixes.items():
        command += [flag, prefix]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"fairseq-preprocess failed:\n{completed.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", type=Path, help="writes OUT_DIR/raw and OUT_DIR/bin")
    parser.add_argument("--vocab", type=int, default=300, help="source words (and target words)")
    parser.add_argument("--train", type=int, default=4000, help="training sentence pairs")
    parser.add_argument("--valid", type=int, default=200, help="validation and test pairs")
    parser.add_argument("--max-len", type=int, default=12, help="longest sentence in words")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if (args.out_dir / "bin").exists():
        parser.error(f"{args.out_dir / 'bin'} exists: choose another OUT_DIR or remove it")
    sizes = {"train": args.train, "valid": args.valid, "test": args.valid}
    write_raw(args.out_dir / "raw", args.vocab, sizes, args.max_len, args.seed)
    binarize(args.out_dir / "raw", args.out_dir / "bin")
    print(args.out_dir / "bin")


if __name__ == "__main__":
    main()
