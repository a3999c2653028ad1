"""The estimator against measured peaks where the layers, not the vocabulary, decide them.

At NLLB sizes the peak falls in the loss or at the end of backward (the 256K vocabulary);
with a small vocabulary and many tokens it falls in a layer's backward, where the layer's
own working set (gradients of its activations, unsharded gradients waiting for their
reduce-scatter) counts. Each shape is measured by ``benchmarks/memory.py`` (the allocator
meter, a fake process group, one real step) and estimated by ``fairseq-shard-estimate``
with the same sizes; the table gives both and their ratio. About 2 minutes on 2 cores.

    python -m benchmarks.estimate_layers     # writes results/estimate_layers.{md,json}
"""

from __future__ import annotations

import json
import subprocess
import sys

from fairseq_shard_plugin.memory.estimate import run as estimate
from launching.harness import REPO, RESULTS

VOCABULARY = 604  # the synthetic corpus's dictionary, padded to 608 by fairseq
SENTENCE = 9  # its tokens per sentence
CHUNKED_AC = ("plugin+chunked-loss+ac", ["--criterion", "chunked_label_smoothed_cross_entropy",
                                         "--checkpoint-activations"])
STOCK_LOSS = ("plugin+cross-entropy", ["--criterion", "cross_entropy"])
# (d, ffn, tokens per rank, precision, layers per stack, ranks, configuration)
SHAPES = [
    (512, 2048, 4096, "fp32", 2, 2, CHUNKED_AC),
    (512, 1024, 4096, "fp32", 2, 2, CHUNKED_AC),
    (256, 2048, 4096, "fp32", 2, 2, CHUNKED_AC),
    (512, 2048, 2048, "fp32", 2, 2, CHUNKED_AC),
    (512, 2048, 4096, "fp32", 3, 2, CHUNKED_AC),
    (512, 2048, 4096, "fp32", 2, 1, CHUNKED_AC),
    (512, 2048, 4096, "bf16", 2, 2, CHUNKED_AC),
    (512, 1024, 4096, "bf16", 2, 2, CHUNKED_AC),
    (512, 2048, 4096, "fp32", 2, 2, STOCK_LOSS),
    (512, 1024, 4096, "fp32", 2, 2, STOCK_LOSS),
]


def model_flags(d: int, ffn: int, layers: int) -> list[str]:
    return ["--arch", "transformer", "--share-all-embeddings",
            "--encoder-layers", str(layers), "--decoder-layers", str(layers),
            "--encoder-embed-dim", str(d), "--decoder-embed-dim", str(d),
            "--encoder-ffn-embed-dim", str(ffn), "--decoder-ffn-embed-dim", str(ffn)]


def measured_mib(model: list[str], configuration: str, tokens: int, precision: str,
                 ranks: int) -> float:
    command = [sys.executable, "-m", "benchmarks.memory", "--only", configuration,
               "--model", " ".join(model), "--vocabulary", str(VOCABULARY), "--tokens",
               str(tokens), "--sentence", str(SENTENCE), "--world-size", str(ranks),
               "--precision", precision]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_gib"] * 1024


def estimated(model: list[str], flags: list[str], tokens: int, precision: str,
              ranks: int) -> tuple[float, str]:
    report = estimate([*model, "--vocab", str(VOCABULARY + 4), "--world-size", str(ranks),
                       "--max-tokens", str(tokens), "--tokens-per-sentence", str(SENTENCE),
                       "--loss-chunk-tokens", "512", *flags,
                       *(["--bf16"] if precision == "bf16" else [])])
    requested = report["configurations"]["requested"]
    return requested["peak_gib"] * 1024, requested["peak_phase"]


def main() -> None:
    rows = []
    for d, ffn, tokens, precision, layers, ranks, (configuration, flags) in SHAPES:
        model = model_flags(d, ffn, layers)
        measured = measured_mib(model, configuration, tokens, precision, ranks)
        estimate_mib, phase = estimated(model, flags, tokens, precision, ranks)
        rows.append({"d": d, "ffn": ffn, "tokens": tokens, "precision": precision,
                     "layers": layers, "ranks": ranks, "configuration": configuration,
                     "measured_mib": round(measured, 1), "estimated_mib": round(estimate_mib, 1),
                     "ratio": round(estimate_mib / measured, 3), "phase": phase})
        print(rows[-1], flush=True)
    lines = ["| d | ffn | tokens | precision | layers | ranks | configuration | measured MiB "
             "| estimated MiB | estimated / measured | estimated peak during |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['d']} | {r['ffn']} | {r['tokens']} | {r['precision']} | {r['layers']}+"
              f"{r['layers']} | {r['ranks']} | {r['configuration']} | {r['measured_mib']} | "
              f"{r['estimated_mib']} | {r['ratio']:.3f} | {r['phase']} |" for r in rows]
    note = ("\n\nPeak per rank of one training step (transformer, shared embeddings, vocabulary "
            f"{VOCABULARY}, sentences of {SENTENCE} tokens, Adam), measured by the allocator "
            "meter (`benchmarks/memory.py --only`, fake process group) and estimated by "
            "`fairseq-shard-estimate` with the same sizes. Produced by `python -m "
            "benchmarks.estimate_layers`.\n")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "estimate_layers.json").write_text(json.dumps(rows, indent=1) + "\n")
    (RESULTS / "estimate_layers.md").write_text("\n".join(lines) + note)
    print("\n".join(lines) + note)


if __name__ == "__main__":
    main()
