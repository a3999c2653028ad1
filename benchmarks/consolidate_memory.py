"""Peak host memory of ``fairseq-shard-consolidate`` at the NLLB-600M shape, against the file
it writes.

Builds two training checkpoints of ``nllb_dense_600m`` (615.1M parameters, vocabulary
256,206, embeddings and output projection tied) as a training run leaves them, with fp32
Adam moments for every parameter: the names and shapes come from fairseq's model built on
the meta device; the values are a deterministic hash of each element's index, the same in both.

* **full**: one ``checkpoint_last.pt`` in ``torch.save``'s format with the structure the
  plugin's full saves have (config, model, Adam state, iterator state, meters), written one
  tensor at a time (``streaming_writer``) so that building it needs no 7 GiB of memory;
* **sharded**: what ``--checkpoint-format sharded`` writes on 2 ranks: two gloo processes
  save their dim-0 halves of every parameter and moment (DTensors, ``Shard(0)``, as FSDP2
  holds them) with DCP, each chunk generated when DCP asks for it (DCP keeps what it wrote
  until its file is complete: each rank peaks near its half, 3.5 GiB), and the index file
  made by the plugin's own ``split_tensors``/``shard_checksums``.

Each case then runs ``fairseq-shard-consolidate`` in a fresh process and reads that
process's peak resident set size from the kernel (``ru_maxrss`` of ``os.wait4``), against
the size of the checkpoint it wrote. The bound is 1.2 x the output size.

    python -m benchmarks.consolidate_memory            # -> benchmarks/results/consolidate_memory.*
    # the same cases with another checkout's consolidate (e.g. before a change), elsewhere:
    python -m benchmarks.consolidate_memory --source-tree /tmp/old --results-dir /tmp/before
    # a results column from such a run:
    python -m benchmarks.consolidate_memory --baseline /tmp/before/consolidate_memory.json \
        --baseline-note "the consolidate of commit ..."

About 5 minutes and 14 GiB of disk (removed after); memory: the two ranks above, then
one consolidation at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch

from fairseq_shard_plugin.checkpoint.stored_tensors import mapped_empty
from launching.harness import REPO, RESULTS, tool

NAME = "consolidate_memory"
ARCH = "nllb_dense_600m"
VOCABULARY = 256206
RANKS = 2
UPDATES = 1000
BOUND = 1.2
MIB = 1 << 20
_BLOCK = 1 << 23  # elements generated at a time
CASES = ("full", "full:fp16", "sharded", "sharded:fp16")


# ---------------------------------------------------------------- the model's shape


def fairseq_layout(arch: str, vocabulary: int
                   ) -> tuple[dict[str, tuple[int, ...]], dict[str, str], list[str], dict]:
    """``arch`` built by fairseq on the meta device: the shape of each tensor,
    each state-dict name's owner (a tied name maps to the first name of its parameter),
    the parameters in optimizer order, and fairseq's config as a checkpoint stores it."""
    from fairseq import options
    from fairseq.data import Dictionary
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.tasks.translation import TranslationConfig, TranslationTask
    from omegaconf import OmegaConf

    from fairseq_shard_plugin.memory.estimate import build_without_memory
    from fairseq_shard_plugin.tasks import register

    register()
    dictionary = Dictionary()
    for index in range(vocabulary - len(dictionary)):
        dictionary.add_symbol(f"t{index}")
    args = options.parse_args_and_arch(options.get_training_parser(), [
        ".", "--task", "translation", "--arch", arch, "--optimizer", "adam",
        "--adam-betas", "(0.9, 0.98)", "--lr", "0.001", "--max-update", str(UPDATES),
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"])
    task = TranslationTask(TranslationConfig(), dictionary, dictionary)
    model = build_without_memory(lambda: task.build_model(args), arch)
    names = set(model.state_dict())
    first_name: dict[int, str] = {}
    owner, shapes = {}, {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        first_name.setdefault(id(tensor), name)
        if name in names:
            owner[name] = first_name[id(tensor)]
            shapes.setdefault(owner[name], tuple(tensor.shape))
    parameters = [first_name[id(p)] for p in model.parameters()]
    config = OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True,
                                    enum_to_str=True)
    return shapes, owner, parameters, config


# ---------------------------------------------------------------- the values


def seed_of(path: str) -> int:
    return zlib.crc32(path.encode())


def fill(flat: torch.Tensor, seed: int, first: int, positive: bool = False) -> torch.Tensor:
    """Elements ``first ...`` of the tensor ``seed`` names, into the 1-d ``flat``: a hash of
    each element's index scaled to [-0.05, 0.05) (or [0, 0.05)), whatever block or rank
    makes them. Temporaries are mapped (malloc's heap would keep them: see stored_tensors)."""
    index = mapped_empty((min(_BLOCK, flat.numel()),), torch.int64)
    for start in range(0, flat.numel(), _BLOCK):
        count = min(_BLOCK, flat.numel() - start)
        hashed = torch.arange(first + start, first + start + count, out=index[:count])
        hashed.mul_(2654435761).add_(seed).remainder_(1 << 31)
        values = flat[start:start + count]
        values.copy_(hashed).mul_(0.1 / (1 << 31)).sub_(0.05)
        if positive:
            values.abs_()
    return flat


def generated(path: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None
              ) -> torch.Tensor:
    """The values of the tensor at ``path`` (rows ``rows`` of it only, if given)."""
    first_row, count = rows if rows is not None else (0, shape[0] if shape else 1)
    row = 1
    for size in shape[1:]:
        row *= size
    out = mapped_empty((count, *shape[1:]) if shape else (), torch.float32)
    fill(out.view(-1), seed_of(path), first_row * row, positive=path.endswith("exp_avg_sq"))
    return out


def training_state(shapes: dict[str, tuple[int, ...]], owner: dict[str, str],
                   parameters: list[str], config: dict, tensor: Any) -> dict[str, Any]:
    """A checkpoint's state as the plugin saves it; ``tensor(path, shape)`` makes each
    parameter and moment (``path`` as ``split_tensors`` names it), a tied weight once;
    buffers are plain tensors, as FSDP2 leaves them."""
    made = {name: tensor(f"model/{name}", shapes[name]) for name in parameters}
    for name in set(owner.values()) - set(made):  # buffers: fairseq's versions are 3
        made[name] = (torch.tensor([3.0]) if name.endswith(".version")
                      else generated(f"model/{name}", shapes[name]))
    model = {name: made[first] for name, first in owner.items()}
    moments = {index: {"step": UPDATES, **{
        kind: tensor(f"last_optimizer_state/state/{index}/{kind}", shapes[name])
        for kind in ("exp_avg", "exp_avg_sq")}} for index, name in enumerate(parameters)}
    return {
        "args": None, "cfg": config, "model": model, "criterion": None,
        "optimizer_history": [{"criterion_name": "LabelSmoothedCrossEntropyCriterion",
                               "optimizer_name": "ShardedMasterOptimizer",
                               "lr_scheduler_state": {"best": None},
                               "num_updates": UPDATES}],
        "task_state": {},
        "extra_state": {"metrics": {}, "previous_training_time": torch.tensor(3600.0,
                                                                              dtype=torch.float64),
                        "train_iterator": {"version": 2, "epoch": 1,
                                           "iterations_in_epoch": UPDATES, "shuffle": True},
                        "val_loss": 4.2},
        "last_optimizer_state": {"state": moments, "param_groups": [{
            "lr": 0.001, "betas": (0.9, 0.98), "eps": 1e-08, "weight_decay": 0.0,
            "params": list(range(len(parameters)))}]},
    }


# ---------------------------------------------------------------- the two formats


def write_full(path: Path, layout: tuple) -> None:
    """The full-format checkpoint, each tensor generated when it is written."""
    from fairseq_shard_plugin.checkpoint.atomic_files import write_atomically
    from fairseq_shard_plugin.checkpoint.streaming_writer import LazyTensor, write_checkpoint

    class Generated(LazyTensor):
        def __init__(self, where: str, shape: tuple[int, ...]) -> None:
            self.where, self.shape, self.dtype = where, shape, torch.float32

        def materialize(self) -> torch.Tensor:
            return generated(self.where, self.shape)

    state = training_state(*layout, tensor=Generated)
    write_atomically(path, lambda out: write_checkpoint(out, state))


def _sharded_rank(rank: int, save_dir: Path, layout: tuple) -> None:
    """One of the ranks that save the sharded checkpoint (``torch.multiprocessing``)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from fairseq_shard_plugin.checkpoint.atomic_files import write_atomically
    from fairseq_shard_plugin.checkpoint.integrity import shard_checksums
    from fairseq_shard_plugin.checkpoint.sharded import SHARDED_KEY, SHARDS_DIR, split_tensors

    dist.init_process_group("gloo", init_method=f"file://{save_dir}/.store", rank=rank,
                            world_size=RANKS)
    mesh = init_device_mesh("cpu", (RANKS,))

    def half(where: str, shape: tuple[int, ...]) -> DTensor:
        """This rank's rows of the tensor, as FSDP2 shards it; generated only when saved."""
        rows = -(-shape[0] // RANKS)
        first = min(rank * rows, shape[0])
        local = torch.empty((min(rows, shape[0] - first), *shape[1:]), device="meta")
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size(shape), stride=_strides(shape))

    class Generating(DefaultSavePlanner):
        def resolve_data(self, item: Any) -> Any:
            data = super().resolve_data(item)
            if not (isinstance(data, torch.Tensor) and data.is_meta):
                return data
            chunk, full = item.tensor_data.chunk, item.tensor_data.size
            if any(o for o in chunk.offsets[1:]) or tuple(chunk.sizes[1:]) != tuple(full[1:]):
                raise AssertionError(f"{item.index.fqn}: not a dim-0 chunk")
            return generated(item.index.fqn, tuple(full), (chunk.offsets[0], chunk.sizes[0]))

    skeleton, tensors = split_tensors(training_state(*layout, tensor=half))
    relative = f"{SHARDS_DIR}/u{UPDATES}-benchmark"
    dcp.save(tensors, checkpoint_id=save_dir / relative, planner=Generating())
    skeleton[SHARDED_KEY] = {"dir": relative, "world_size": RANKS, "version": 1,
                             "crc32": shard_checksums(save_dir / relative)}
    if rank == 0:
        write_atomically(save_dir / "checkpoint_last.pt", lambda out: torch.save(skeleton, out))
    dist.barrier()
    dist.destroy_process_group()


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def write_sharded(save_dir: Path, layout: tuple) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_sharded_rank, args=(save_dir, layout), nprocs=RANKS)


# ---------------------------------------------------------------- measuring


def consolidate_command(source: Path, out: Path, precision: str | None,
                        tree: Path | None) -> list[str]:
    flags = [f"--{precision}"] if precision else []
    if tree is None:
        return [tool("fairseq-shard-consolidate"), str(source), str(out), *flags]
    return [sys.executable, "-m", "fairseq_shard_plugin.cli.consolidate", str(source), str(out),
            *flags]


# Runs the command and reports its peak RSS. A child's ru_maxrss starts from the memory of
# the process it was forked from (Linux keeps the larger across exec), so the command is
# started from this small Python, not from the benchmark's (fairseq imported, ~1 GiB).
_WRAPPER = """
import os, sys
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as report:
    report.write(f"{usage.ru_maxrss * 1024} {os.waitstatus_to_exitcode(status)}")
"""


def peak_rss_of(command: list[str], env: dict[str, str], cwd: Path
                ) -> tuple[int, float, str]:
    """Run ``command``; its peak resident set size (bytes), wall time and output."""
    with tempfile.NamedTemporaryFile("r") as report:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-S", "-c", _WRAPPER, report.name, *command],
                              env=env, cwd=cwd, capture_output=True, text=True)
        seconds = time.monotonic() - started
        peak, returncode = (int(word) for word in report.read().split())
    output = (done.stdout + done.stderr).strip()
    if done.returncode != 0 or returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({returncode}):\n{output}")
    return peak, seconds, output


def record_checksums(path: Path) -> list[int]:
    """CRC-32 of each tensor record of a written checkpoint (from its zip directory)."""
    with zipfile.ZipFile(path) as archive:
        return [info.CRC for info in archive.infolist() if "/data/" in info.filename]


def input_bytes(source: Path) -> int:
    """The checkpoint file plus, for an index, its shards."""
    shards = source.parent / "checkpoint_shards"
    extra = sum(p.stat().st_size for p in shards.rglob("*") if p.is_file()) if (
        shards.is_dir()) else 0
    return source.stat().st_size + extra


def measure(case: str, sources: dict[str, Path], work: Path, tree: Path | None
            ) -> dict[str, Any]:
    kind, _, precision = case.partition(":")
    source, out = sources[kind], work / f"out-{kind}-{precision or 'fp32'}.pt"
    command = consolidate_command(source, out, precision or None, tree)
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
    peak, seconds, output = peak_rss_of(command, env, tree or REPO)
    size = out.stat().st_size
    row = {"case": case, "format": kind, "precision": precision or "fp32",
           "input_gib": round(input_bytes(source) / 2**30, 2),
           "output_mib": round(size / MIB, 1), "peak_rss_mib": round(peak / MIB, 1),
           "peak_over_output": round(peak / size, 3), "within_bound": peak <= BOUND * size,
           "seconds": round(seconds, 1), "tensor_records": len(record_checksums(out)),
           "records_crc32": zlib.crc32(json.dumps(record_checksums(out)).encode()),
           "command": (f"cd {tree} && " if tree else "") + " ".join(command), "output": output}
    out.unlink()
    print(json.dumps({k: v for k, v in row.items() if k != "output"}), flush=True)
    return row


# ---------------------------------------------------------------- results


def write_tables(rows: list[dict], baseline: list[dict] | None, results: Path,
                 command: str, model: str, floor: int, baseline_note: str) -> str:
    before = {row["case"]: row for row in baseline or []}
    columns = ["case", "input (GiB, with Adam state)", "output (MiB)", "peak RSS (MiB)",
               "peak / output", f"<= {BOUND} x output", "time (s)"]
    if before:
        columns += ["before: peak RSS (MiB)", "before: peak / output"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [row["case"], row["input_gib"], row["output_mib"], row["peak_rss_mib"],
                 row["peak_over_output"], "yes" if row["within_bound"] else "NO", row["seconds"]]
        if before:
            old = before.get(row["case"], {})
            cells += [old.get("peak_rss_mib", "n/a"), old.get("peak_over_output", "n/a")]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    same = {row["precision"]: set() for row in rows}
    for row in rows:
        same[row["precision"]].add(row["records_crc32"])
    agreement = ", ".join(f"{p}: {'identical' if len(s) == 1 else 'DIFFERENT'}"
                          for p, s in same.items())
    if before:
        equal = all(before.get(row["case"], {}).get("records_crc32") == row["records_crc32"]
                    for row in rows)
        agreement += (f"; and {'identical' if equal else 'NOT identical'} to those of the "
                      f"\"before\" commands ({baseline_note})")
    text = "\n".join([
        f"Peak resident memory of `fairseq-shard-consolidate` (a fresh process per case, "
        f"`ru_maxrss`) against the checkpoint it writes, {model}, from training checkpoints "
        f"holding fp32 Adam moments: `full` (one file) and `sharded` (DCP shards of {RANKS} "
        "ranks and an index). Tensor records of the full and sharded outputs, by precision: "
        f"{agreement}.", "", *lines, "",
        f"Produced by `{command}` (CPU, {os.cpu_count()} cores, shared with other work). "
        "Peak RSS of each command "
        "started by a small wrapper process (a command's `ru_maxrss` starts from its "
        f"parent's; the wrapper running `/bin/true` reads {floor / MIB:.0f} MiB). "
        "Consolidation commands:", "",
        *[f"    {row['command']}" for row in rows], "",
        *([f"\"before\" ({baseline_note}):", "",
           *[f"    {row['command']}" for row in baseline or []], ""] if before else [])])
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{NAME}.md").write_text(text)
    (results / f"{NAME}.json").write_text(json.dumps(rows, indent=2) + "\n")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--work-dir", type=Path, help="where the checkpoints go (reused if "
                        "they are there; default: a temporary directory, removed after)")
    parser.add_argument("--source-tree", type=Path,
                        help="run the consolidate of this checkout (PYTHONPATH) instead")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--baseline", type=Path, help="a JSON of this benchmark to compare")
    parser.add_argument("--baseline-note", default="another run",
                        help="what the baseline measured, for the table's note")
    parser.add_argument("--arch", default=ARCH, help="another fairseq architecture (a quick "
                        "check: transformer_iwslt_de_en --vocabulary 1000)")
    parser.add_argument("--vocabulary", type=int, default=VOCABULARY)
    args = parser.parse_args(argv)
    cases = [case for case in args.cases.split(",") if case]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="consolidate_memory-"))
    try:
        sources, parameters = build_checkpoints(
            work, {case.partition(":")[0] for case in cases}, args.arch, args.vocabulary)
        rows = [measure(case, sources, work, args.source_tree) for case in cases]
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    shown = ["python", "-m", "benchmarks.consolidate_memory",
             *(argv if argv is not None else sys.argv[1:])]
    model = (f"`{args.arch}` ({parameters / 1e6:.1f}M parameters, "
             f"vocabulary {args.vocabulary}, tied embeddings stored once)")
    floor = peak_rss_of(["/bin/true"], dict(os.environ), REPO)[0]
    print(write_tables(rows, baseline, args.results_dir, shlex.join(shown), model, floor,
                       args.baseline_note))


def build_checkpoints(work: Path, kinds: set[str], arch: str, vocabulary: int
                      ) -> tuple[dict[str, Path], int]:
    """The checkpoints the cases need, built unless ``work`` holds them already; and the
    model's number of parameters."""
    sources = {kind: work / kind / "checkpoint_last.pt" for kind in kinds}
    missing = [kind for kind, path in sources.items() if not path.exists()]
    work.mkdir(parents=True, exist_ok=True)
    described = work / "model.json"
    if missing or not described.exists():
        layout = fairseq_layout(arch, vocabulary)
        count = sum(torch.Size(layout[0][name]).numel() for name in layout[2])
        described.write_text(json.dumps({"arch": arch, "vocabulary": vocabulary,
                                         "parameters": count}))
    for kind in missing:
        shutil.rmtree(work / kind, ignore_errors=True)
        (work / kind).mkdir(parents=True)
        started = time.monotonic()
        if kind == "full":
            write_full(sources[kind], layout)
        else:
            write_sharded(work / kind, layout)
        print(f"built the {kind} checkpoint in {time.monotonic() - started:.0f} s: "
              f"{input_bytes(sources[kind]) / 2**30:.2f} GiB", flush=True)
    return sources, json.loads(described.read_text())["parameters"]


if __name__ == "__main__":
    main()
