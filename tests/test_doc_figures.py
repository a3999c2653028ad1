"""Figures quoted in the README and docs are those of the committed result files (each
produced by the command printed next to it), so that none can go stale silently: a new
benchmark run that changes a figure fails here until the prose says the same."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from launching.harness import REPO, run_concurrently, tool

RESULTS = REPO / "benchmarks" / "results"

# README's memory table: row label (its start) -> (result file, configuration)
README_MEMORY_ROWS = {
    "unsharded": ("memory", "unsharded"),
    "stock policy": ("memory", "stock-policy"),
    "plugin (per-layer units": ("memory", "plugin"),
    "+ `--criterion chunked_label_smoothed_cross_entropy`": ("memory", "plugin+chunked-loss"),
    "+ `--checkpoint-activations`": ("memory", "plugin+chunked-loss+ac"),
    "+ `--reduce-vocabulary-in-16-bit`": (
        "memory", "plugin+chunked-loss+ac+16-bit-vocab-reduce"),
    "+ `--keep-vocabulary-gathered`": (
        "memory", "plugin+chunked-loss+ac+16-bit-vocab-reduce+vocab-gathered"),
    "+ `--memory-efficient-bf16`": ("memory_16_bit_state", "nllb-settings+16-bit-params"),
    "+ `--fp16-adam-stats`": ("memory_16_bit_state", "nllb-settings+16-bit-state"),
    "chunked loss + checkpointing + `--cpu-offload`": (
        "memory", "plugin+chunked-loss+ac+offload"),
}


def rows(name: str) -> list[dict]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def figures(text: str) -> list[float]:
    return [float(value) for value in re.findall(r"\d+\.\d+", text.replace("**", ""))]


def test_the_readmes_memory_table_is_the_measured_one() -> None:
    table = [line for line in (REPO / "README.md").read_text().splitlines()
             if line.startswith("| ") and not line.startswith(("| configuration", "|---"))]
    seen = set()
    for line in table:
        label, peak, device = [cell.strip() for cell in line.strip("|").split("|")]
        matches = [key for key in README_MEMORY_ROWS if label.startswith(key)]
        if not matches:
            continue
        name, configuration = README_MEMORY_ROWS[matches[0]]
        measured = next(row for row in rows(name) if row["configuration"] == configuration)
        assert figures(peak)[0] == round(measured["peak_gib"], 2), label
        assert figures(device)[0] == round(measured["device_gib"], 2), label
        seen.add(matches[0])
    assert seen == set(README_MEMORY_ROWS)


def host_adam(implementation: str, threads: int) -> float:
    row = next(row for row in rows("host_adam")
               if row["implementation"] == implementation and row["threads"] == threads)
    return row["ns_per_element"]


# docs/nllb.md's paragraph on the host's Adam step: quoted pairs (one thread, two threads)
HOST_ADAM_PAIRS = {
    "fairseq's Adam": "fairseq Adam (fp32)",
    "the plugin's": "plugin ShardedAdam (fp32)",
    "(bf16 parameters, fp16 moments)": "plugin, bf16 params + fp16 moments, C step",
    "against": "plugin, bf16 params + fp16 moments, torch step",
    "for\n`torch.compile`": "torch.compile, bf16 params + fp16 moments",
    "`DeepSpeedCPUAdam`": "DeepSpeed CPUAdam (fp32)",
}


@pytest.mark.parametrize("doc", ["docs/nllb.md", "docs/precision.md"])
def test_the_host_adam_figures_are_the_measured_ones(doc: str) -> None:
    text = (REPO / doc).read_text()
    start = text.index("ns per element" if doc.endswith("nllb.md") else "NLLB-600M\nat")
    paragraph = text[start - 400:start + 1400]
    quoted = set(figures(paragraph))
    implementations = (HOST_ADAM_PAIRS.values() if doc.endswith("nllb.md") else
                       ["plugin, bf16 params + fp16 moments, C step",
                        "plugin, bf16 params + fp16 moments, torch step",
                        "plugin ShardedAdam (fp32)"])
    for implementation in implementations:
        for threads in (1, 2):
            assert host_adam(implementation, threads) in quoted, (implementation, threads)


def test_the_offload_doc_quotes_the_host_adam_figures() -> None:
    text = (REPO / "docs" / "multi-node-and-offload.md").read_text()
    assert f"{host_adam('plugin ShardedAdam (fp32)', 2)} against " \
           f"{host_adam('fairseq Adam (fp32)', 2)} ns per element" in text
    assert f"{host_adam('plugin, bf16 params + fp16 moments, C step', 2)} ns per element" in text


def test_every_result_file_a_doc_links_exists() -> None:
    """Links from the README and docs into benchmarks/results point at committed files."""
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]*benchmarks/results/[^)#]+)\)", doc.read_text()):
            assert (doc.parent / target).resolve().exists(), (doc.name, target)


def test_figures_in_docs_name_their_command() -> None:
    """Each result file a doc quotes says in its Markdown how it was produced."""
    for markdown in RESULTS.glob("*.md"):
        text = markdown.read_text()
        assert "python" in text or "make " in text or "bash " in text, markdown.name


@pytest.mark.e2e
def test_the_readmes_one_gpu_figures_are_the_estimators() -> None:
    """The README quotes `fairseq-shard-estimate --config configs/nllb/finetune_3_3b_1gpu.yaml
    --world-size 1`: the GPU peak, and the host while training and while saving."""
    done = subprocess.run([tool("fairseq-shard-estimate"), "--config",
                           str(REPO / "configs/nllb/finetune_3_3b_1gpu.yaml"),
                           "--world-size", "1", "--json"],
                          capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(done.stdout[done.stdout.index("{"):])
    cases = report["host"]["cases"]
    readme = " ".join((REPO / "README.md").read_text().split())
    expected = (f"**{report['configurations']['requested']['peak_gib']:.2f} GiB on the GPU** "
                f"at 4,096 tokens, {cases['training step']['per_rank_gib']:.1f} GiB on the host "
                f"while training ({cases['save, sharded format']['per_rank_gib']:.1f} while "
                "saving)")
    assert expected in readme


def test_the_readmes_other_figures_are_the_measured_ones() -> None:
    readme = " ".join((REPO / "README.md").read_text().split())
    plugin, stock = rows("demo")[:2]  # python -m benchmarks.demo --out benchmarks/results
    assert plugin["run"].startswith("plugin") and stock["run"].startswith("stock")
    rss = round(100 * (1 - plugin["peak_rss_mib_per_rank"] / stock["peak_rss_mib_per_rank"]))
    tensors = round(100 * (1 - plugin["peak_mib_per_rank"] / stock["peak_mib_per_rank"]))
    assert f"per rank {rss}% less peak RSS and {tensors}% less peak tensor memory" in readme
    gpu = {row["configuration"]: row["device_gib"]
           for row in rows("gpu-2026-12-04/gpu_memory_600m")}
    assert (f"{gpu['nllb-settings+16-bit-state']:.2f} GiB per rank with the recipe's 16-bit "
            f"state, {gpu['stock-policy']:.2f} with stock's policy") in readme
    (one_rank,) = rows("memory_1_3b_one_rank")
    assert f"Measured at 1.3B on one rank: {one_rank['device_gib']:.2f} GiB" in readme


def test_the_offload_doc_quotes_the_overlap_figures() -> None:
    text = " ".join((REPO / "docs" / "multi-node-and-offload.md").read_text().split())
    quoted = {1: "{hidden} of the step's wait on one rank ({background} s against {inline} s)",
              2: "{hidden} on two ({background} s against {inline} s)"}
    for ranks, template in quoted.items():
        inline, background = rows(f"host_step_overlap_{ranks}rank")
        assert template.format(hidden=background["hidden"], inline=inline["host_wait_s"],
                               background=background["host_wait_s"]) in text, ranks


def test_the_readmes_option_table_lists_every_plugin_option() -> None:
    from dataclasses import fields

    from fairseq_shard_plugin.sharding.options import ShardingConfig

    text = (REPO / "README.md").read_text()
    for option in fields(ShardingConfig):
        if not option.name.startswith("_"):
            flag = "--" + option.name.replace("_", "-")
            assert f"| `{flag}` |" in text, flag
            # its default, as the table writes it (it once said `full` for `auto`)
            default = option.default
            written = ("off" if default is False else "none" if default is None
                       else str(default) if isinstance(default, int) else f"`{default}`")
            cell = text.split(f"| `{flag}` | ", 1)[1].split(" |", 1)[0]
            assert cell.split(" (", 1)[0] == written, (flag, cell, written)


def estimated_peaks(commands: dict[str, list[str]]) -> dict[str, float]:
    """Each ``fairseq-shard-estimate`` command's requested peak per rank (GiB, as printed)."""
    done = run_concurrently({name: [tool("fairseq-shard-estimate"), *args, "--json"]
                             for name, args in commands.items()})
    peaks = {}
    for name, completed in done.items():
        assert completed.returncode == 0, completed.stderr[-2000:]
        report = json.loads(completed.stdout[completed.stdout.index("{"):])
        peaks[name] = report["configurations"]["requested"]["peak_gib"]
    return peaks


@pytest.mark.e2e
def test_the_docs_estimates_of_the_nllb_configs_are_the_estimators() -> None:
    """nllb.md and memory.md quote the estimator for the NLLB configs and for the precision
    modes at 600M: the same figures, or the test names the one that went stale."""
    configs = {size: ["--config", str(REPO / f"configs/nllb/dense_{size}.yaml"),
                      "--world-size", "2"] for size in ("600m", "1_3b", "3_3b")}
    for size in ("600m", "1_3b", "3_3b"):
        configs[f"{size}, one micro-batch"] = [*configs[size], "--update-freq", "1"]
    features = ["--arch", "nllb_dense_600m", "--world-size", "2", "--max-tokens", "4096",
                "--criterion", "chunked_label_smoothed_cross_entropy",
                "--checkpoint-activations"]
    modes = {"fp16": ["--fp16"], "fp16 moments": ["--fp16", "--fp16-adam-stats"],
             "16-bit": ["--memory-efficient-fp16"],
             "16-bit state": ["--memory-efficient-fp16", "--fp16-adam-stats"]}
    peaks = estimated_peaks({**configs, **{name: features + extra
                                           for name, extra in modes.items()}})
    nllb = " ".join((REPO / "docs" / "nllb.md").read_text().split())
    assert (f"{peaks['600m']:.2f} GiB per rank at 600M on 2 ranks, {peaks['1_3b']:.2f} at "
            f"1.3B, {peaks['3_3b']:.2f} at 3.3B") in nllb
    single = [f"{peaks[f'{size}, one micro-batch']:.2f}" for size in ("600m", "1_3b", "3_3b")]
    assert f"{single[0]}, {single[1]} and {single[2]} adding `--update-freq 1`" in nllb
    readme = " ".join((REPO / "README.md").read_text().split())
    assert (f"the NLLB configs use 1024: {peaks['600m, one micro-batch']:.2f} estimated, "
            f"{peaks['600m']:.2f} with their two micro-batches per update") in readme
    memory = " ".join((REPO / "docs" / "memory.md").read_text().split())
    assert f"--world-size 2` ({peaks['1_3b']:.2f} GiB:" in memory
    assert f"second micro-batch on: {single[1]} adding `--update-freq 1`" in memory
    assert (f"{peaks['fp16']:.2f} GiB per rank with `--fp16`, {peaks['fp16 moments']:.2f} "
            f"adding `--fp16-adam-stats`, {peaks['16-bit']:.2f} with "
            f"`--memory-efficient-fp16`, {peaks['16-bit state']:.2f} adding") in memory


@pytest.mark.e2e
def test_memory_md_quotes_the_estimators_largest_batches_and_host_cases() -> None:
    """The --memory-budget 22 figures memory.md quotes for 600M, 1.3B and 3.3B (offloaded)
    with the chunked loss and activation checkpointing, and its host cases on 8 GPUs (the
    build's figures went stale when layers were sharded as built)."""
    budget = ["--vocab", "256206", "--world-size", "2", "--max-tokens", "4096", "--fp16",
              "--memory-budget", "22", "--criterion", "chunked_label_smoothed_cross_entropy",
              "--checkpoint-activations", "--json"]
    commands = {"600m": ["--arch", "nllb_dense_600m", *budget],
                "1_3b": ["--arch", "nllb_dense_1_3b", *budget],
                "3_3b": ["--arch", "nllb_dense_3_3b", *budget, "--cpu-offload"],
                "host": ["--arch", "nllb_dense_600m", "--world-size", "8",
                         "--memory-efficient-fp16", "--fp16-adam-stats", "--cpu-offload",
                         "--json"]}
    done = run_concurrently({name: [tool("fairseq-shard-estimate"), *args]
                             for name, args in commands.items()})
    reports = {name: json.loads(completed.stdout) for name, completed in done.items()}
    tokens = {name: report["fits"]["max_tokens"]["requested"]
              for name, report in reports.items() if report["fits"]}
    memory = " ".join((REPO / "docs" / "memory.md").read_text().split())
    assert (f"command gives {tokens['600m']:,} tokens per rank; for `nllb_dense_1_3b` the same "
            f"command gives {tokens['1_3b']:,}") in memory
    assert f"with `--cpu-offload` as well {tokens['3_3b']:,} (its" in memory
    host = reports["host"]["host"]
    build, step = (host["cases"][name] for name in ("model construction", "training step"))
    assert (f"needs {build['per_rank_gib']:.2f} GiB per rank to build the model "
            f"({build['per_host_gib']:.2f} per host), {step['per_rank_gib']:.2f} in the step "
            f"({step['per_host_gib']:.2f})") in memory
    assert (f"host peak of {host['peak']['per_rank_gib']:.2f} GiB per rank and "
            f"{host['peak']['per_host_gib']:.2f} per host") in memory


def test_memory_md_quotes_the_demo_as_measured() -> None:
    """docs/memory.md copies the demo's headline and table from results/demo.md (python -m
    benchmarks.demo --out benchmarks/results): the same, and the plugin's peak RSS the lower."""
    demo = (RESULTS / "demo.md").read_text()
    memory = (REPO / "docs" / "memory.md").read_text()
    table = [line for line in demo.splitlines() if line.startswith("|")]
    assert "\n".join(table) in memory
    headline = " ".join(demo.split("\n\n", 1)[0].split())
    quoted = headline.split("whole process peaked at ", 1)[1].split(", with the same")[0]
    assert quoted in " ".join(memory.split())
    plugin, stock = rows("demo")[:2]
    assert plugin["peak_rss_mib_per_rank"] < stock["peak_rss_mib_per_rank"]
