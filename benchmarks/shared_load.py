"""Host memory of N ranks of one host loading one full checkpoint, mapped or read.

The plugin loads full checkpoints with ``torch.load(..., mmap=True, weights_only=True)``
(``training/trainer_files.py``) and each rank copies only its slice of every tensor into
its shards. Mapped, the file's pages are page cache shared by all ranks of the host; read
(``mmap=False``), every rank holds a private copy of the whole file. This measures both for
an NLLB-600M-shaped checkpoint of fp32 weights (a released model's layout): N fresh
processes each load the file, keep dim-0 slices as FSDP2 shards them, touch every element,
and report their peak RSS and their proportional share (PSS: a page mapped by two processes
counts half in each) of file-backed and anonymous memory, from ``/proc/self/smaps_rollup``.

    python -m benchmarks.shared_load                 # 2 ranks
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.host_adam import make_tensors, nllb_600m_shapes
from launching.harness import write_results

GIB = 1024**3
RANK_SCRIPT = """
import json, sys, torch
path, rank, ranks, mmap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
shards = []
for tensor in state["model"].values():
    rows = -(-tensor.shape[0] // ranks)
    shards.append(tensor[rank * rows:(rank + 1) * rows].clone())  # this rank's slice
    float(tensor.sum())  # every page of the file read, as a load that checks it does
fields = {}
for line in open("/proc/self/smaps_rollup"):
    parts = line.split()
    if parts[0].endswith(":") and len(parts) >= 2 and parts[1].isdigit():
        fields[parts[0][:-1]] = int(parts[1]) * 1024
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        fields["VmHWM"] = int(line.split()[1]) * 1024
print(json.dumps({"rank": rank, **fields, "shard_bytes": sum(s.nbytes for s in shards)}))
"""


def write_checkpoint(path: Path) -> int:
    shapes = nllb_600m_shapes()
    model = {f"param{index}": tensor for index, tensor in enumerate(
        make_tensors(shapes, seed=0, scale=0.02))}
    torch.save({"model": model}, path)
    return path.stat().st_size


def load_on_ranks(path: Path, ranks: int, mmap: bool) -> list[dict]:
    processes = [subprocess.Popen(
        [sys.executable, "-c", RANK_SCRIPT, str(path), str(rank), str(ranks), str(int(mmap))],
        stdout=subprocess.PIPE, text=True) for rank in range(ranks)]
    reports = []
    for process in processes:
        out, _ = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"a rank failed ({process.returncode})")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    options = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "checkpoint.pt"
        file_bytes = write_checkpoint(path)
        for mmap in (True, False):
            reports = load_on_ranks(path, options.ranks, mmap)
            rows.append({
                "load": "torch.load(mmap=True) (the plugin)" if mmap else "torch.load(mmap=False)",
                "ranks": options.ranks, "file_gib": round(file_bytes / GIB, 2),
                "peak_rss_per_rank_gib": round(max(r["VmHWM"] for r in reports) / GIB, 2),
                "file_pss_all_ranks_gib": round(sum(r.get("Pss_File", 0)
                                                    for r in reports) / GIB, 2),
                "anonymous_all_ranks_gib": round(sum(r.get("Pss_Anon", 0)
                                                     for r in reports) / GIB, 2),
                "shards_all_ranks_gib": round(sum(r["shard_bytes"] for r in reports) / GIB, 2),
            })
            print(json.dumps(rows[-1]), flush=True)
    columns = [("load", "load"), ("ranks", "ranks"), ("file", "file_gib"),
               ("peak RSS per rank", "peak_rss_per_rank_gib"),
               ("file pages, all ranks (PSS)", "file_pss_all_ranks_gib"),
               ("anonymous, all ranks (PSS)", "anonymous_all_ranks_gib"),
               ("shards kept, all ranks", "shards_all_ranks_gib")]
    note = (f"GiB. {options.ranks} fresh processes of one host load one NLLB-600M-shaped "
            "checkpoint of fp32 weights, keep their dim-0 slices and read every element; "
            "RSS and PSS (shared pages divided among the processes mapping them) from "
            "/proc/self/smaps_rollup after the load, peak RSS from VmHWM. Produced by "
            f"`python -m benchmarks.shared_load --ranks {options.ranks}`.")
    print(write_results("shared_load", rows, columns, note))


if __name__ == "__main__":
    main()
