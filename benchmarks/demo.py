"""``make demo``: the plugin against stock fairseq, side by side, on 2 CPU ranks.

Generates a synthetic corpus, binarises it, trains the same transformer twice with the same
seed and batches: once with ``--user-dir fairseq_shard_plugin --ddp-backend fully_sharded``,
once with stock fairseq (``--ddp-backend legacy_ddp``, no plugin). Both run under
``fairseq-shard-measure-train``, so memory is measured the same way for both: each rank's
whole-process peak RSS and peak of live tensor bytes. The model (42M parameters: d 768, ffn
3072, 2+2 layers, a 12k vocabulary) is large enough that its model state (16 bytes per
parameter with Adam) outweighs the Python process, so sharding shows in the whole
process's memory too, and small batches (128 tokens per rank) keep the run to about two
minutes on 2 cores.

Writes ``demo.md`` (the headline first: memory per rank, then the losses), ``demo.json``
and ``demo.png`` (memory per rank, then the loss curves) to ``--out``: by default the run's
own folder ``demo_work/results``, so a demo never overwrites the committed figures;
``--out benchmarks/results`` refreshes those (the README's).

The two runs are the same computation in a different order: FSDP2 reduce-scatters each
unit's gradients where DDP all-reduces one flat bucket, so the float sums round
differently (the tests hold the first 50 updates to 1e-4). Training amplifies the rounding
differences, so after a few hundred updates the two runs are two trainings from slightly
different points. The table reports how far apart the
curves end up (largest relative difference of the per-update training losses, and of the
validation losses), measured, not assumed.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from fairseq_shard_plugin.cli.synthetic_data import make_corpus
from fairseq_shard_plugin.memory.host_allocator import MMAP_THRESHOLD, VARIABLE
from launching import harness
from launching.harness import (
    REPO,
    RunResult,
    run_training,
    training_args,
    transformer_args,
    write_results,
)

MIB = 1024**2


def prepare_corpus(work: Path) -> Path:
    if (work / "corpus" / "bin" / "dict.src.txt").exists():
        return work / "corpus" / "bin"
    return make_corpus(work / "corpus", vocab=6000, train=4000, valid=100)


def summarize(name: str, run: RunResult) -> dict[str, object]:
    train, valid = run.logs["train"][-1], run.logs["valid"][-1]
    return {
        "losses": run.series("train_inner", "loss"),
        "valid_updates": run.series("valid", "valid_num_updates"),
        "valid_losses": run.series("valid", "valid_loss"),
        "rank_peak_mib": [round(r["peak_bytes"] / MIB, 1) for r in run.memory],
        "rank_rss_mib": [round(r["peak_rss_bytes"] / MIB, 1) for r in run.memory],
        "run": name,
        "peak_mib_per_rank": round(max(rank["peak_bytes"] for rank in run.memory) / MIB, 1),
        "peak_rss_mib_per_rank": round(max(r["peak_rss_bytes"] for r in run.memory) / MIB, 1),
        "train_loss": float(train["train_loss"]),
        "valid_loss": float(valid["valid_loss"]),
        "words_per_second": float(train["train_wps"]),
        "updates": int(float(train["train_num_updates"])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--work", type=Path, default=REPO / "demo_work")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the results go (default: WORK/results)")
    args = parser.parse_args()
    out = args.out or args.work / "results"
    # glibc returns freed blocks of 8 MiB and more to the system at once, in both runs (the
    # plugin sets this on CPU ranks itself; stock fairseq does not): by default glibc keeps
    # them, and peak RSS then shows the most memory ever obtained rather than what was live
    os.environ.setdefault(VARIABLE, str(MMAP_THRESHOLD))
    data = prepare_corpus(args.work)
    model = transformer_args(dim=768, ffn=3072, layers=2, heads=8)
    rows = []
    for name, plugin in [("plugin: fully_sharded (FSDP2, per-layer units)", True),
                         ("stock fairseq: legacy_ddp", False)]:
        tag = "plugin" if plugin else "stock"
        shutil.rmtree(args.work / tag, ignore_errors=True)
        train = training_args(data, args.work / tag / "checkpoints", args.updates,
                              max_tokens=128)
        # Memory is measured by the launcher for both runs alike; the plugin's own
        # per-step meter would only add overhead to its words/s here.
        extra = ["--log-interval", "1", "--validate-interval-updates", "20", "--no-save"] + (
            ["--task", "sharded_translation", "--no-memory-report"] if plugin else [])
        print(f"training: {name} ...", flush=True)
        run = run_training(train + model + extra, nproc=2, plugin=plugin,
                           measure_dir=args.work / tag / "memory", timeout=3600)
        rows.append(summarize(name, run))
    plugin, stock = rows
    drift = drift_note(plugin, stock)
    headline = (
        f"**Per rank, the plugin's whole process peaked at {plugin['peak_rss_mib_per_rank']:.0f} "
        f"MiB of RSS against stock fairseq's {stock['peak_rss_mib_per_rank']:.0f} MiB "
        f"({_change(plugin, stock, 'peak_rss_mib_per_rank')}), and at "
        f"{plugin['peak_mib_per_rank']:.0f} MiB of live tensors against "
        f"{stock['peak_mib_per_rank']:.0f} ({_change(plugin, stock, 'peak_mib_per_rank')}), "
        f"with the same losses** (training loss over the run {plugin['train_loss']:.3f} against "
        f"{stock['train_loss']:.3f}).")
    harness.RESULTS = out
    chart = draw(rows, args.updates, out)
    table = write_results("demo", rows, [
        ("run", "run"), ("peak RSS / rank (MiB)", "peak_rss_mib_per_rank"),
        ("peak tensor memory / rank (MiB)", "peak_mib_per_rank"), ("train loss", "train_loss"),
        ("valid loss", "valid_loss"), ("words/s", "words_per_second"),
    ], f"{drift}\n\n"
       + (f"![memory per rank and loss curves]({chart.name})\n\n" if chart else "")
       + "Produced by `make demo` (2 gloo ranks on this CPU machine; 42M-parameter "
         f"transformer, 128 tokens per rank and update, {args.updates} updates; both runs "
         f"with {VARIABLE}={os.environ[VARIABLE]}, so that glibc returns freed blocks of "
         "that size and more at once, as the plugin has it do on CPU ranks by itself; with "
         "glibc's default, peak RSS shows the most memory ever obtained, which per-unit "
         "gathers raise, rather than what was live).")
    (out / "demo.md").write_text(f"{headline}\n\n{table}")
    print(f"\n{headline}\n\n{table}\nwritten to {out}")


def _change(plugin: dict, stock: dict, key: str) -> str:
    return f"{100 * (plugin[key] / stock[key] - 1):+.0f}%"


def _relative(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


def drift_note(plugin: dict, stock: dict) -> str:
    """How far the plugin's curves are from stock fairseq's, first updates and overall."""
    train = _relative(plugin["losses"], stock["losses"])
    valid = _relative(plugin["valid_losses"], stock["valid_losses"])
    late = next((i + 1 for i, d in enumerate(train) if d > 1e-3), None)
    span = (f"{max(train[:50]):.1e} over the first 50 updates, {max(train):.1e} over all "
            f"{len(train)}" if len(train) > 50 else
            f"{max(train):.1e} over all {len(train)} updates")
    return (f"Training losses, plugin vs stock, per update: largest relative difference "
            f"{span}" + (f" (above 1e-3 from update {late})" if late else "")
            + f"; validation losses: largest {max(valid):.1e}. Same "
            "data, seed and batches: the difference is float rounding (FSDP2 reduces "
            "gradients per unit, DDP per bucket), amplified by training.")


def draw(rows: list[dict], updates: int, out: Path) -> Path | None:
    """Per-rank memory and loss curves of both runs as ``OUT/demo.png``; None when
    matplotlib is missing (the ``bench`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no demo.png: matplotlib is not installed (make demo installs it, or pip "
              "install -e '.[bench]')", flush=True)
        return None
    figure, (memory, losses) = plt.subplots(1, 2, figsize=(12, 4.5))
    for row, style in zip(rows, ("-", "--"), strict=True):
        label = str(row["run"]).split(":")[0]
        losses.plot(range(1, len(row["losses"]) + 1), row["losses"], style, label=f"{label} train")
        losses.plot(row["valid_updates"], row["valid_losses"], style, marker="o",
                    label=f"{label} valid")
    losses.set(xlabel="update", ylabel="loss (base 2)", title=f"Losses over {updates} updates")
    losses.legend(fontsize=8)
    ranks = len(rows[0]["rank_peak_mib"])
    width = 0.2
    for index, row in enumerate(rows):
        label = str(row["run"]).split(":")[0]
        offsets = [rank + (index - 0.5) * 2 * width for rank in range(ranks)]
        memory.bar([o - width / 2 for o in offsets], row["rank_peak_mib"], width,
                   label=f"{label}: peak tensors")
        memory.bar([o + width / 2 for o in offsets], row["rank_rss_mib"], width,
                   label=f"{label}: peak RSS", alpha=0.5)
    memory.set_xticks(range(ranks), [f"rank {rank}" for rank in range(ranks)])
    memory.set(ylabel="MiB", title="Peak memory per rank: lower is better")
    memory.set_ylim(0, 1.3 * max(max(row["rank_rss_mib"]) for row in rows))
    memory.legend(fontsize=8, loc="upper center", ncol=2)
    figure.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "demo.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


if __name__ == "__main__":
    main()
