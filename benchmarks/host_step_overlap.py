"""How much of the offloaded host Adam step the next forward hides, on CPU ranks.

Trains the same transformer with ``--cpu-offload`` and the one-GPU recipe's 16-bit host
state (``--memory-efficient-bf16 --fp16-adam-stats``; bf16 because CPUs compute it) twice,
with the host step in line (``--no-host-step-overlap``) and in the background
(the default), and reports per steady update (after ``--warmup`` updates):

- ``host_wait``: seconds the update waited for the host step (the plugin's own log
  metric: the step's in-line part, plus with the overlap the forwards' waits);
- the update's wall time (``fairseq-shard-measure-train``'s update starts).

On CPU ranks the forward and the host step share the host's cores: each rank computes on
one thread (torchrun's ``OMP_NUM_THREADS=1``) and steps on one, so on a 2-core machine one
rank has a core for each. The model is sized so that the step is not negligible next to a
forward of ``--max-tokens`` tokens, as on a GPU, where the forward is fast.

    python -m benchmarks.host_step_overlap            # 1 rank, d 1024, 4+4 layers
    python -m benchmarks.host_step_overlap --ranks 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from fairseq_shard_plugin.cli.synthetic_data import make_corpus
from launching.harness import run_training, training_args, transformer_args, write_results


def measure(corpus: Path, work: Path, args: argparse.Namespace, overlap: bool) -> dict:
    """One run; the steady updates' medians."""
    name = "background" if overlap else "in line"
    flags = training_args(corpus, work / name, args.updates, max_tokens=args.max_tokens) + [
        *transformer_args(args.dim, 4 * args.dim, args.layers, heads=8),
        "--task", "sharded_translation", "--no-save", "--disable-validation",
        "--cpu-offload", "--memory-efficient-bf16", "--fp16-adam-stats",
        *([] if overlap else ["--no-host-step-overlap"])]
    run = run_training(flags, nproc=args.ranks, plugin=True, measure_dir=work / f"{name}-m",
                       timeout=3600)
    waits = run.series("train_inner", "host_wait")[args.warmup:]
    starts = run.memory[0]["update_starts"]
    walls = [starts[i + 1] - starts[i] for i in range(len(starts) - 1)][args.warmup:]
    return {"host step": name, "ranks": args.ranks,
            "host_wait_s": round(statistics.median(waits), 4),
            "update_s": round(statistics.median(walls), 4),
            "updates": len(walls), "loss": run.series("train_inner", "loss")[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--updates", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        corpus = make_corpus(work / "corpus")
        rows = [measure(corpus, work, args, overlap) for overlap in (False, True)]
    inline, background = rows
    for row in rows:
        row["hidden"] = (f"{1 - row['host_wait_s'] / inline['host_wait_s']:.0%}"
                         if row is background else "")
    assert inline["loss"] == background["loss"], (inline["loss"], background["loss"])
    command = ("python -m benchmarks.host_step_overlap " + " ".join(
        f"--{key.replace('_', '-')} {value}" for key, value in vars(args).items()))
    note = (f"Command: `{command}`. d {args.dim}, {args.layers}+{args.layers} layers, "
            f"{args.max_tokens} tokens per rank and update, CPU ranks (gloo, one compute "
            "thread each); medians over the steady updates. The losses are identical.")
    print(write_results(
        f"host_step_overlap_{args.ranks}rank", rows,
        [("host step", "host step"), ("ranks", "ranks"),
         ("waited for it per update (s)", "host_wait_s"), ("update (s)", "update_s"),
         ("hidden", "hidden"), ("updates", "updates")], note))


if __name__ == "__main__":
    main()
