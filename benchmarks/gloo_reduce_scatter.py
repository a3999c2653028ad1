"""Host memory of one reduce-scatter over gloo, the CPU ranks' backend.

FSDP reduce-scatters each unit's unsharded gradient after its backward. On CPU ranks that
runs over gloo; this measures what one ``reduce_scatter_tensor`` of a given fp32 input
adds to a rank's peak RSS (``VmHWM``) beyond its input, on 2 ranks started by torchrun.
The estimator models the collective's input and output only; what gloo holds besides
them shows here.

    python -m benchmarks.gloo_reduce_scatter [--gib 0.5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from launching.harness import RESULTS, free_port, rank_environment, tool, write_results

RANK_SCRIPT = """
import json, sys, torch, torch.distributed as dist

def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

dist.init_process_group("gloo")
elements = int(float(sys.argv[1]) * 2**30) // 4
tensor = torch.randn(elements)
output = torch.zeros(elements // dist.get_world_size())  # its pages touched before
before = peak_rss()
dist.reduce_scatter_tensor(output, tensor)
after = peak_rss()
if dist.get_rank() == 0:
    print(json.dumps({"input_bytes": tensor.nbytes, "before": before, "after": after}))
dist.destroy_process_group()
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=0.5, help="the fp32 input's size")
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        script = Path(directory) / "rank.py"
        script.write_text(RANK_SCRIPT)
        completed = subprocess.run(
            [tool("torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
             str(script), str(options.gib)], capture_output=True, text=True, timeout=300,
            env=rank_environment())
    if completed.returncode != 0:
        raise RuntimeError(completed.stderr[-3000:])
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    gib = 1024**3
    row = {"input_gib": round(report["input_bytes"] / gib, 2),
           "added_gib": round((report["after"] - report["before"]) / gib, 2),
           "added_per_input": round((report["after"] - report["before"])
                                    / report["input_bytes"], 2)}
    print(json.dumps(row))
    note = ("GiB, rank 0 of 2 torchrun ranks on one host: what one reduce_scatter_tensor of "
            "an fp32 input over gloo adds to the rank's peak RSS (VmHWM), its output's pages "
            "already touched. Produced by `python -m benchmarks.gloo_reduce_scatter --gib "
            f"{options.gib}`.")
    RESULTS.mkdir(parents=True, exist_ok=True)
    print(write_results("gloo_reduce_scatter", [row], [
        ("input", "input_gib"), ("added to peak RSS", "added_gib"),
        ("added per input byte", "added_per_input")], note))


if __name__ == "__main__":
    main()
