"""Per-rank peak memory of one training step, broken down, for each sharding configuration.

Measures an N-rank job in one process per configuration: a fake process group of world
size N (``torch.testing._internal.distributed.fake_pg``) makes every shard, all-gather and
reduce-scatter buffer real while no other rank exists, so a 615M-parameter model can be
measured at its full shape on one machine. Each configuration runs the plugin's real
``ShardedTrainer.train_step`` (fairseq's task, model, criterion and Adam) on a synthetic batch
and reads the plugin's own step meter: CUDA allocator statistics on a GPU; on CPU the CPU
allocator's own events (``allocator_meter.AllocatorMeter``). Loss values under a fake group
are meaningless and are not reported.

Breakdown (per rank, with Adam's state created before the measured step):
  params / grads / optimizer: the parameter shards (fp32 masters, or 16-bit under
  ``--memory-efficient-*``), their gradients and Adam's moments (fp16 with
  ``--fp16-adam-stats``);
  activations: bytes live when the loss is computed beyond the resident state (tensors saved
  for backward, and parameters a unit keeps gathered);
  temporaries: the rest of the peak (gathered parameters, unsharded gradients and reduction
  buffers, logits and their gradients in backward).

    python -m benchmarks.memory                       # NLLB 600M shape, 2 ranks, 4096 tokens
    python -m benchmarks.memory --arch transformer --tokens 512 ...   # any fairseq arch
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from launching.fake_group import trainer_on_fake_group
from launching.harness import RESULTS, write_results

GIB = 1024**3


@dataclass(frozen=True)
class Configuration:
    """One row of the table: a name, a world size, and the fairseq flags that make it."""

    name: str
    description: str
    world_size: int | None  # None: the run's --world-size
    flags: tuple[str, ...]


STOCK_LOSS = ("--criterion", "label_smoothed_cross_entropy")
CHUNKED_LOSS = ("--criterion", "chunked_label_smoothed_cross_entropy")
CONFIGURATIONS = (
    Configuration("unsharded", "DDP-like: one rank's full model state, nothing sharded", 1,
                  ("--root-unit-only", "--keep-root-gathered", *STOCK_LOSS)),
    Configuration("stock-policy", "stock fairseq's plan: one root unit, never resharded",
                  None, ("--root-unit-only", "--keep-root-gathered", *STOCK_LOSS)),
    Configuration("plugin", "plugin: per-layer units, tied vocabulary unit, root resharded",
                  None, STOCK_LOSS),
    Configuration("plugin+chunked-loss", "+ chunked_label_smoothed_cross_entropy", None,
                  CHUNKED_LOSS),
    Configuration("plugin+chunked-loss+ac", "+ --checkpoint-activations", None,
                  (*CHUNKED_LOSS, "--checkpoint-activations")),
    Configuration("plugin+chunked-loss+ac+16-bit-vocab-reduce",
                  "+ --reduce-vocabulary-in-16-bit", None,
                  (*CHUNKED_LOSS, "--checkpoint-activations", "--reduce-vocabulary-in-16-bit")),
    Configuration("plugin+chunked-loss+ac+16-bit-vocab-reduce+vocab-gathered",
                  "+ --keep-vocabulary-gathered: one all-gather of the vocabulary per step "
                  "(the NLLB configs' settings)",
                  None, (*CHUNKED_LOSS, "--checkpoint-activations", "--reduce-vocabulary-in-16-bit",
                         "--keep-vocabulary-gathered")),
    Configuration("plugin+chunked-loss+ac+offload",
                  "+ --cpu-offload: shards, gradients and optimizer state on the host", None,
                  (*CHUNKED_LOSS, "--checkpoint-activations", "--cpu-offload")),
)
# the NLLB configs' settings (configs/nllb/*.yaml), with each model-state precision
NLLB_SETTINGS = (*CHUNKED_LOSS, "--checkpoint-activations", "--reduce-vocabulary-in-16-bit",
                 "--keep-vocabulary-gathered")
# measured only when named in --configurations (not part of the default table)
OPTIONAL_CONFIGURATIONS = (
    Configuration("nllb-settings+16-bit-params", "the NLLB settings with "
                  "--memory-efficient-bf16: 16-bit parameter and gradient shards, fp32 Adam "
                  "moments (12 B per parameter, as fairseq's memory-efficient mode)", None,
                  (*NLLB_SETTINGS, "--memory-efficient-bf16")),
    Configuration("nllb-settings+16-bit-state", "... and --fp16-adam-stats: 16-bit moments "
                  "too (8 B per parameter, Meta's NLLB recipe)", None,
                  (*NLLB_SETTINGS, "--memory-efficient-bf16", "--fp16-adam-stats")),
    Configuration("nllb-settings+16-bit-state-one-rank", "the same on one rank (as the GPU "
                  "check's NLLB-configs training row)", 1,
                  (*NLLB_SETTINGS, "--memory-efficient-bf16", "--fp16-adam-stats")),
    Configuration("nllb-settings+16-bit-state+offload", "... and --cpu-offload: the model "
                  "state on the host (configs/nllb/finetune_3_3b_1gpu.yaml at world size 1)",
                  None, (*NLLB_SETTINGS, "--memory-efficient-bf16", "--fp16-adam-stats",
                         "--cpu-offload")),
    Configuration("plugin+cross-entropy", "fairseq's cross_entropy criterion (no label "
                  "smoothing) instead of label_smoothed_cross_entropy", None,
                  ("--criterion", "cross_entropy")),
    Configuration("plugin+zero2", "+ --no-reshard-after-forward: every unit gathered from "
                  "its forward to its backward", None, (*STOCK_LOSS, "--no-reshard-after-forward")),
    Configuration("plugin+chunked-loss+ac+2-layers-per-unit", "chunked loss, activation "
                  "checkpointing and --layers-per-unit 2: two layers gathered per unit", None,
                  (*CHUNKED_LOSS, "--checkpoint-activations", "--layers-per-unit", "2")),
    Configuration("plugin+chunked-loss+ac+zero2", "chunked loss, activation checkpointing and "
                  "--no-reshard-after-forward", None,
                  (*CHUNKED_LOSS, "--checkpoint-activations", "--no-reshard-after-forward")),
)
DEFAULT_CONFIGURATIONS = ",".join(c.name for c in CONFIGURATIONS)
NLLB_600M = ("--arch", "nllb_dense_600m")


def write_dictionary(directory: Path, vocabulary: int) -> None:
    """A joined source/target dictionary with ``vocabulary`` entries (fairseq adds 4)."""
    lines = "".join(f"w{i} 1\n" for i in range(vocabulary - 4))
    for lang in ("src", "tgt"):
        (directory / f"dict.{lang}.txt").write_text(lines)


def fairseq_flags(data: Path, options: argparse.Namespace, config: Configuration) -> list[str]:
    precision = {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}[options.precision]
    return [
        str(data), "--task", "sharded_translation", "--source-lang", "src",
        "--target-lang", "tgt", *options.model, "--share-all-embeddings",
        "--ddp-backend", "fully_sharded", "--optimizer", options.optimizer,
        *(["--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-6"]
          if options.optimizer == "adam" else []),
        "--lr", "1e-4", "--dropout", "0.1",
        *([] if "cross_entropy" in config.flags else ["--label-smoothing", "0.1"]),
        "--max-tokens", str(options.tokens), "--clip-norm", "1.0", *precision,
        *(["--loss-chunk-tokens", str(options.loss_chunk_tokens)]
          if "chunked_label_smoothed_cross_entropy" in config.flags else []),
        *([] if options.cuda else ["--cpu"]), *config.flags,
    ]


def synthetic_batch(vocabulary: int, tokens: int, sentence: int, device: str) -> dict:
    """``tokens`` source and target tokens in sentences of ``sentence`` tokens (no padding)."""
    import torch

    sentences = max(1, tokens // sentence)
    generator = torch.Generator().manual_seed(0)
    source = torch.randint(4, vocabulary, (sentences, sentence), generator=generator)
    target = torch.randint(4, vocabulary, (sentences, sentence), generator=generator)
    target[:, -1] = 2  # eos
    previous = torch.cat([torch.full((sentences, 1), 2), target[:, :-1]], dim=1)
    sample = {
        "id": torch.arange(sentences), "nsentences": sentences, "ntokens": target.numel(),
        "net_input": {"src_tokens": source, "src_lengths": torch.full((sentences,), sentence),
                      "prev_output_tokens": previous},
        "target": target,
    }
    return _to_device(sample, device)


def _to_device(value: object, device: str) -> object:
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    return value


def measure_one(options: argparse.Namespace, config: Configuration) -> dict:
    """Measure one step of ``config`` under a fake process group."""
    import torch

    from fairseq_shard_plugin.memory.allocator_meter import AllocatorMeter
    from fairseq_shard_plugin.memory.meters import StepMemoryProbe, storage_bytes

    world_size = config.world_size or options.world_size
    with tempfile.TemporaryDirectory() as data:
        write_dictionary(Path(data), options.vocabulary)
        trainer = trainer_on_fake_group(fairseq_flags(Path(data), options, config), world_size)
    task = trainer.task
    if not options.cuda:  # exact on this single-threaded fake group, see allocator_meter.py
        trainer._memory_probe = StepMemoryProbe(trainer.device, AllocatorMeter)
    parameters = sum(p.numel() for p in trainer.model.parameters())
    device = "cuda" if options.cuda else "cpu"
    sample = synthetic_batch(len(task.target_dictionary), options.tokens, options.sentence,
                             device)
    backward = trainer.optimizer.backward

    def record_then_backward(loss: torch.Tensor) -> None:
        trainer._memory_probe.mark("forward")  # what the forward pass left alive
        backward(loss)

    trainer.optimizer.backward = record_then_backward
    create_optimizer_state(trainer)
    start = time.perf_counter()
    trainer.train_step([sample])
    seconds = time.perf_counter() - start
    step = trainer._memory_probe.result
    params = storage_bytes(trainer.model.parameters())
    grads = storage_bytes(p.grad for p in trainer.optimizer.params if p.grad is not None)
    optimizer_state = storage_bytes(
        v for state in trainer.optimizer.optimizer.state.values()
        for v in state.values() if isinstance(v, torch.Tensor)
    )
    buffers = storage_bytes(trainer.model.buffers())
    activations = step.marks["forward"] - params - optimizer_state - buffers
    temporaries = step.peak_allocated - params - grads - optimizer_state - buffers - activations
    return {
        "configuration": config.name, "description": config.description,
        "world_size": world_size, "parameters": parameters, "tokens": options.tokens,
        "precision": options.precision, "device": device,
        "peak_gib": step.peak_allocated / GIB,
        # accelerator-side: without the host-side state of --cpu-offload (else the peak)
        "device_gib": step.peak_device / GIB,
        "reserved_gib": None if step.peak_reserved is None else step.peak_reserved / GIB,
        "params_gib": params / GIB, "grads_gib": grads / GIB,
        "optimizer_gib": optimizer_state / GIB, "buffers_gib": buffers / GIB,
        "activations_gib": activations / GIB, "temporaries_gib": temporaries / GIB,
        "model_state_gib": (params + grads + optimizer_state) / GIB,
        "step_seconds": seconds,
    }


def create_optimizer_state(trainer: object) -> None:
    """Give Adam its state before the measured step, as in every step after the first:
    one optimizer step on zero gradients, which leaves the parameters unchanged."""
    import torch

    params = trainer.optimizer.params
    for param in params:
        param.grad = torch.zeros_like(param)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad()


def run_configuration(options: argparse.Namespace, config: Configuration) -> dict:
    """Measure one configuration in a fresh process, so no configuration sees another's."""
    command = [sys.executable, "-m", "benchmarks.memory", "--only", config.name,
               *_forwarded(options)]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode == -signal.SIGKILL:  # the kernel's out-of-memory killer
        print(f"{config.name}: killed, out of host memory", file=sys.stderr)
        return {"configuration": config.name, "description": config.description,
                "world_size": config.world_size or options.world_size,
                "out_of_memory": True}
    if completed.returncode != 0:
        raise RuntimeError(f"{config.name} failed:\n{completed.stderr[-4000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _forwarded(options: argparse.Namespace) -> list[str]:
    return ["--model", " ".join(options.model), "--vocabulary", str(options.vocabulary),
            "--world-size", str(options.world_size), "--tokens", str(options.tokens),
            "--sentence", str(options.sentence), "--precision", options.precision,
            "--loss-chunk-tokens", str(options.loss_chunk_tokens),
            "--optimizer", options.optimizer, *(["--cuda"] if options.cuda else [])]


COLUMNS = [
    ("configuration", "configuration"), ("ranks", "world_size"), ("peak", "peak"),
    ("device", "device"),
    ("params", "params"), ("grads", "grads"), ("optimizer", "optimizer"),
    ("activations", "activations"), ("temporaries", "temporaries"),
    ("model state", "model_state"), ("step (s)", "step_seconds"),
]


def table_rows(results: list[dict]) -> list[dict]:
    """Rounded rows; a configuration that did not fit in host memory reads n/a."""
    keys = ("peak", "device", "params", "grads", "optimizer", "activations", "temporaries",
            "model_state")
    rows = []
    for row in results:
        measured = not row.get("out_of_memory")
        rows.append({
            **{key: round(row[f"{key}_gib"], 2) if measured else None for key in keys},
            "configuration": row["configuration"] + ("" if measured else " (out of host memory)"),
            "world_size": row["world_size"],
            "step_seconds": round(row["step_seconds"], 1) if measured else None,
        })
    return rows


def draw_chart(results: list[dict], path: Path) -> bool:
    """A stacked bar per configuration; False when matplotlib is missing (``.[bench]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    parts = ("params", "grads", "optimizer", "activations", "temporaries")
    results = [row for row in results if not row.get("out_of_memory")]
    figure, axes = plt.subplots(figsize=(10, 5))
    names = [row["configuration"].replace("+", "\n+") for row in results]
    bottom = [0.0] * len(results)
    for part in parts:
        values = [max(row[f"{part}_gib"], 0.0) for row in results]
        axes.bar(names, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    offloaded = [(name, row["device_gib"]) for name, row in zip(names, results, strict=True)
                 if row.get("device_gib", row["peak_gib"]) < row["peak_gib"]]
    if offloaded:  # --cpu-offload: what stays on the device
        axes.scatter([n for n, _ in offloaded], [d for _, d in offloaded], marker="_", s=1500,
                     color="black", linewidths=3, label="device (offload)", zorder=3)
    axes.set_ylabel("GiB per rank")
    axes.set_title("Peak memory per rank, one training step")
    axes.legend()
    axes.tick_params(axis="x", labelsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=" ".join(NLLB_600M),
                        help="fairseq model flags (default: --arch nllb_dense_600m)")
    parser.add_argument("--vocabulary", type=int, default=256206)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank and step")
    parser.add_argument("--sentence", type=int, default=64, help="tokens per sentence")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16",
                        help="compute precision (fp16 matmuls are very slow on most CPUs; "
                        "bf16 holds the same bytes)")
    parser.add_argument("--loss-chunk-tokens", type=int, default=512,
                        help="chunk size of the chunked criterion")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                        help="sgd (no state) measures models whose Adam state would not fit "
                        "this host's memory; under --cpu-offload the state is host-side only")
    parser.add_argument("--cuda", action="store_true", help="measure on the current CUDA device")
    parser.add_argument("--configurations", default=DEFAULT_CONFIGURATIONS,
                        help="comma-separated; also: " + ", ".join(
                            c.name for c in OPTIONAL_CONFIGURATIONS))
    parser.add_argument("--name", default="memory", help="results file stem")
    parser.add_argument("--only", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    options.model = options.model.split()
    return options


def host_memory() -> str:
    """The host's RAM and swap: rows whose peak exceeds the RAM ran partly in swap, which
    slows their step (the tensor figures come from allocator events and do not change)."""
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        return ""
    fields = {}
    for line in meminfo.read_text().splitlines():
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) / 2**20  # kB -> GiB
    return (f"Host: {fields.get('MemTotal', 0):.1f} GiB RAM, "
            f"{fields.get('SwapTotal', 0):.1f} GiB swap.")


def main(argv: list[str] | None = None) -> None:
    options = parse_options(argv)
    by_name = {c.name: c for c in (*CONFIGURATIONS, *OPTIONAL_CONFIGURATIONS)}
    if options.only:
        print(json.dumps(measure_one(options, by_name[options.only])))
        return
    results = []
    for name in options.configurations.split(","):
        results.append(run_configuration(options, by_name[name]))
        if not results[-1].get("out_of_memory"):
            print(f"{name}: peak {results[-1]['peak_gib']:.2f} GiB per rank", flush=True)
    selection = ([] if options.configurations == DEFAULT_CONFIGURATIONS
                 else ["--configurations", options.configurations])
    named = [] if options.name == "memory" else ["--name", options.name]
    command = "python -m benchmarks.memory " + " ".join(
        a if " " not in a else f"'{a}'" for a in [*_forwarded(options), *selection, *named])
    device = "cuda" if options.cuda else "cpu"
    optimizer = "Adam" if options.optimizer == "adam" else "SGD (no optimizer state)"
    note = (f"GiB per rank, {options.tokens} tokens per rank, {options.precision} compute, "
            f"fp32 master shards (16-bit where the row says), {optimizer}, measured on "
            f"{device} with a fake process "
            f"group; device: the peak without the host-side state of --cpu-offload. "
            f"{host_memory()} Produced by `{command}`.")
    RESULTS.mkdir(parents=True, exist_ok=True)
    if draw_chart(results, RESULTS / f"{options.name}.png"):
        note += f" Chart: `benchmarks/results/{options.name}.png`."
    table = write_results(options.name, table_rows(results), COLUMNS, note)
    (RESULTS / f"{options.name}.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table)


if __name__ == "__main__":
    main()
