"""CPU offload and hybrid sharding in real fairseq-train runs on gloo CPU ranks.

Hybrid: two "nodes" on this machine (two torchrun invocations on loopback, 2 ranks each)
against one 4-rank fully sharded run. Offload: 2 ranks with and without ``--cpu-offload``.
Node sizes and Slurm's variables are checked as plain functions of an environment.
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import pytest
import torch

from fairseq_shard_plugin.checkpoint.consolidate import read_full_state
from fairseq_shard_plugin.checkpoint.sharded import is_sharded_index
from fairseq_shard_plugin.errors import ShardingConfigError
from fairseq_shard_plugin.memory.meters import (
    LiveTensorMeter,
    StepMemoryProbe,
    watch_offloaded_state,
)
from fairseq_shard_plugin.sharding.options import ShardingConfig
from fairseq_shard_plugin.sharding.settings import ranks_per_node, shard_group_size
from fairseq_shard_plugin.training.launch_env import (
    default_allocator_setting,
    first_slurm_host,
    host_threads_per_rank,
    slurm_as_torchrun,
)
from launching.harness import (
    PLUGIN_DIR,
    REPO,
    RunResult,
    free_port,
    in_threads,
    parse_logs,
    rank_environment,
    result_of,
    run_like_srun,
    run_training,
    tool,
    training_args,
)

from tiny_training import SHARDED, TINY, relative_difference, reshard

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)

UPDATES = 6
OFFLOAD_UPDATES = 4
CHECKSUMS = REPO / "tests" / "helpers" / "train_with_checksums.py"


def sharded_args(corpus: Path, save_dir: Path, updates: int = UPDATES) -> list[str]:
    return training_args(corpus, save_dir, updates) + TINY + [
        "--task", "sharded_translation", "--no-epoch-checkpoints", "--disable-validation"]


def run_two_nodes(args: list[str], checksum_dir: Path) -> RunResult:
    """Two torchrun invocations (node ranks 0 and 1, 2 ranks each) on loopback."""
    env = rank_environment()
    port = free_port()
    nodes = [
        subprocess.Popen(
            [tool("torchrun"), "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node",
             "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
             str(CHECKSUMS), str(checksum_dir), *args, "--user-dir", str(PLUGIN_DIR),
             "--ddp-backend", "fully_sharded", "--shard-strategy", "hybrid"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-6000:]
    return RunResult(0, outputs[0], parse_logs(outputs[0]))


@pytest.fixture(scope="module")
def full_run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[RunResult, Path]:
    save_dir = tmp_path_factory.mktemp("full4")
    return run_training(sharded_args(corpus, save_dir), nproc=4, plugin=True), save_dir


@pytest.fixture(scope="module")
def hybrid_run(
    corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[RunResult, Path, Path]:
    """Saves in the sharded format, so that its checkpoint also tests a 2-D mesh's shards."""
    save_dir, checksums = tmp_path_factory.mktemp("hybrid"), tmp_path_factory.mktemp("sums")
    args = sharded_args(corpus, save_dir) + list(SHARDED)
    return run_two_nodes(args, checksums), save_dir, checksums


def test_hybrid_replicas_hold_identical_shards_after_every_update(
    hybrid_run: tuple[RunResult, Path, Path],
) -> None:
    _, _, checksums = hybrid_run
    ranks = [[json.loads(line) for line in (checksums / f"rank{rank}.jsonl").open()]
             for rank in range(4)]
    assert [entry["update"] for entry in ranks[0]] == list(range(1, UPDATES + 1))
    for step in range(UPDATES):
        digests = [ranks[rank][step]["sha256"] for rank in range(4)]
        # mesh (replicate, shard): node 0 holds ranks 0, 1; node 1 ranks 2, 3
        assert digests[0] == digests[2] and digests[1] == digests[3], step
        assert digests[0] != digests[1]  # two different shards, not one full copy


def test_hybrid_loss_and_norm_match_four_rank_full_sharding(
    hybrid_run: tuple[RunResult, Path, Path], full_run: tuple[RunResult, Path]
) -> None:
    hybrid, full = hybrid_run[0], full_run[0]
    assert ("sharded over 4 ranks as 2 groups of 2 (hybrid: each group holds one sharded "
            "copy) with fsdp2") in hybrid.output  # it said "over 4 ranks", as full sharding
    for key in ("loss", "gnorm"):  # a double-counted replica would inflate gnorm by sqrt(2)
        hybrid_series, full_series = hybrid.series("train_inner", key), full.series(
            "train_inner", key)
        assert len(hybrid_series) == len(full_series) == UPDATES
        assert relative_difference(hybrid_series, full_series) <= 1e-4, key
    assert hybrid.series("train_inner", "loss")[-1] < hybrid.series("train_inner", "loss")[0]


def test_hybrid_checkpoint_holds_the_full_model(
    hybrid_run: tuple[RunResult, Path, Path], full_run: tuple[RunResult, Path]
) -> None:
    hybrid = read_full_state(hybrid_run[1] / "checkpoint_last.pt")  # gathers the shards
    full = torch.load(full_run[1] / "checkpoint_last.pt", weights_only=True)
    assert hybrid["model"].keys() == full["model"].keys()
    for name, tensor in full["model"].items():
        assert hybrid["model"][name].shape == tensor.shape
        torch.testing.assert_close(hybrid["model"][name], tensor, rtol=1e-4, atol=1e-5)


def test_hybrid_sharded_checkpoint_reloads_exactly_on_two_plain_ranks(
    corpus: Path, hybrid_run: tuple[RunResult, Path, Path], tmp_path: Path
) -> None:
    """The hybrid run's sharded checkpoint (2 shard groups of 2 ranks on a 2-D mesh) reloads
    on a 1-D mesh of 2 ranks with its model and Adam state equal bit for bit."""
    checkpoint = hybrid_run[1] / "checkpoint_last.pt"
    shards = hybrid_run[1] / torch.load(checkpoint, weights_only=True)["sharded_checkpoint"]["dir"]
    assert len(list(shards.glob("*.distcp"))) == 4
    (reloaded,) = reshard(2, corpus, tmp_path / "two", {"exact": [str(checkpoint)]})["exact"]
    assert reloaded["model_equal"] and reloaded["optimizer_equal"], reloaded
    assert reloaded["optimizer_tensors"] > 0 and reloaded["num_updates"] == UPDATES


def run_as_srun(args: list[str], ranks: int) -> RunResult:
    """Ranks started the way ``srun --ntasks-per-node N fairseq-train ...`` starts them."""
    command = [tool("fairseq-train"), *args, "--user-dir", str(PLUGIN_DIR),
               "--ddp-backend", "fully_sharded", "--distributed-port", str(free_port())]
    outputs = run_like_srun(command, ranks)
    return RunResult(0, outputs[0], parse_logs(outputs[0]))


@pytest.fixture(scope="module")
def offload_pair(
    corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[RunResult, RunResult]:
    """2 ranks under torchrun with ``--cpu-offload``; the same 2 ranks without offload,
    started the way srun starts them (so that run also checks the Slurm launch)."""
    save_dir = tmp_path_factory.mktemp("offload")
    args = sharded_args(corpus, save_dir, OFFLOAD_UPDATES) + ["--no-save"]
    return (run_training(args + ["--cpu-offload"], nproc=2, plugin=True),
            run_as_srun(args, ranks=2))


def test_one_rank_with_offload_trains_as_two_sharded_ranks_and_as_unsharded_fairseq(
    corpus: Path, tmp_path: Path, offload_pair: tuple[RunResult, RunResult]
) -> None:
    """World size 1 (one GPU, or here one CPU process) with --cpu-offload: the same batches
    as 2 ranks when it accumulates 2 micro-batches per update, and the same losses as
    stock fairseq on one process. Offloaded, it saves in the sharded format (a full save
    would gather the whole state in host memory) and says so."""
    def args(save_dir: Path, task: str) -> list[str]:
        return [(task if a == "sharded_translation" else a)
                for a in sharded_args(corpus, save_dir, OFFLOAD_UPDATES)] + ["--update-freq", "2"]

    runs = in_threads({
        "alone": lambda: run_training(args(tmp_path, "sharded_translation") + ["--cpu-offload"],
                                      nproc=1, plugin=True),
        "stock": lambda: run_training(args(tmp_path / "stock", "translation"), nproc=1,
                                      plugin=False)})  # fairseq's own task: no plugin
    alone, stock = result_of(runs, "alone"), result_of(runs, "stock")
    assert "sharded over 1 ranks with fsdp2" in alone.output
    assert "--cpu-offload: checkpoints are saved in the sharded format" in alone.output
    assert is_sharded_index(torch.load(tmp_path / "checkpoint_last.pt", weights_only=True))
    _, two_ranks = offload_pair
    for key in ("loss", "gnorm"):
        series = alone.series("train_inner", key)
        assert len(series) == OFFLOAD_UPDATES
        assert relative_difference(series, two_ranks.series("train_inner", key)) <= 1e-3, key
        assert relative_difference(series, stock.series("train_inner", key)) <= 1e-3, key


def test_offloaded_run_reaches_the_same_loss(offload_pair: tuple[RunResult, RunResult]) -> None:
    offloaded, resident = offload_pair
    for key in ("loss", "gnorm"):
        series = offloaded.series("train_inner", key)
        assert len(series) == OFFLOAD_UPDATES
        assert relative_difference(series, resident.series("train_inner", key)) <= 1e-6, key
    # Adam on offloaded shards is the plugin's (torch's fused CPU kernel), never apex's
    # FusedAdam (GPU state only)
    assert "fused implementation: fp32 parameters, fp32 moments, on the host" in offloaded.output
    assert "fused implementation" not in resident.output


def test_sharded_cuda_runs_get_expandable_segments_unless_the_allocator_is_set() -> None:
    environ: dict[str, str] = {}
    assert default_allocator_setting(environ) == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for mine in ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"},
                 {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}):
        before = dict(mine)
        assert default_allocator_setting(mine) is None and mine == before
    cpu: dict[str, str] = {}
    assert default_allocator_setting(cpu, use_cuda=False) is None and not cpu


def test_each_rank_of_a_node_gets_its_share_of_the_host_threads() -> None:
    assert host_threads_per_rank({"LOCAL_WORLD_SIZE": "2"}, cores=16) == 8
    assert host_threads_per_rank({"LOCAL_WORLD_SIZE": "8"}, cores=4) == 1
    assert host_threads_per_rank({}, cores=6) == 6


def test_ranks_started_by_srun_train_as_one_job(
    offload_pair: tuple[RunResult, RunResult],
) -> None:
    _, srun = offload_pair
    assert "sharded over 2 ranks with fsdp2" in srun.output
    assert len(srun.series("train_inner", "loss")) == OFFLOAD_UPDATES  # one log: one job


def test_offload_lowers_device_memory_by_at_least_the_optimizer_state(
    offload_pair: tuple[RunResult, RunResult],
) -> None:
    offloaded, resident = offload_pair
    assert "device_mem_gb" not in resident.logs["train_inner"][0]
    device = offloaded.series("train_inner", "device_mem_gb")
    peak = resident.series("train_inner", "peak_mem_gb")
    state = resident.series("train_inner", "state_mem_gb")  # params + grads + Adam (2x params)
    # From the second update on the optimizer state exists for the whole step.
    for update in range(1, OFFLOAD_UPDATES):
        optimizer_state = state[update] / 2
        assert peak[update] - device[update] >= optimizer_state, update
    # the host-side state itself is still there, and still 1/N
    assert offloaded.series("train_inner", "state_mem_gb") == state


def test_node_size_comes_from_the_launcher() -> None:
    assert ranks_per_node({"LOCAL_WORLD_SIZE": "8", "SLURM_NTASKS_PER_NODE": "4"}) == 8
    assert ranks_per_node({"SLURM_NTASKS_PER_NODE": "4", "SLURM_GPUS_ON_NODE": "8"}) == 4
    assert ranks_per_node({"SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "8"}) == 8
    assert ranks_per_node({}) is None
    hybrid = ShardingConfig(shard_strategy="hybrid")
    assert shard_group_size(hybrid, 16, {"LOCAL_WORLD_SIZE": "8"}) == 8
    assert shard_group_size(ShardingConfig(shard_strategy="hybrid", shard_group_size=4), 16,
                            {"LOCAL_WORLD_SIZE": "8"}) == 4
    assert shard_group_size(ShardingConfig(), 16, {"LOCAL_WORLD_SIZE": "8"}) == 16


@pytest.mark.parametrize(
    ("world", "environ", "message"),
    [
        (6, {"LOCAL_WORLD_SIZE": "4"}, "world size 6 is not a multiple of 4"),
        (4, {}, "give --shard-group-size"),
    ],
)
def test_unworkable_hybrid_layouts_are_refused(
    world: int, environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ShardingConfigError, match=message) as error:
        shard_group_size(ShardingConfig(shard_strategy="hybrid"), world, environ)
    assert "\n" not in str(error.value) and "--shard-" in str(error.value)


def test_hybrid_on_one_node_falls_back_to_full_sharding_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A configuration written for a cluster runs on a workstation."""
    hybrid = ShardingConfig(shard_strategy="hybrid")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # validation and the trainer both ask: one line
            assert shard_group_size(hybrid, 4, {"LOCAL_WORLD_SIZE": "4"}) == 4
    assert [r.getMessage() for r in caplog.records] == [
        "--shard-strategy hybrid: all 4 ranks form one shard group (4 ranks per group), so "
        "this run shards fully over them (as --shard-strategy full); hybrid sharding needs "
        "more than one group"]


def test_the_one_node_warning_stays_quiet_on_srun_ranks_other_than_0(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """srun sets SLURM_PROCID, not RANK: rank 5 of 6 must not repeat rank 0's line."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    with caplog.at_level(logging.WARNING):
        assert shard_group_size(ShardingConfig(shard_strategy="hybrid"), 6,
                                {"SLURM_NTASKS_PER_NODE": "6"}) == 6
    assert caplog.records == []


def test_ranks_started_by_srun_get_torchruns_variables() -> None:
    assert first_slurm_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_slurm_host("node5,node6") == "node5"
    assert first_slurm_host("rack[2-3]-n[01-04]") == "rack2-n01"
    srun = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
            "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-10]",
            "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_JOB_ID": "4242"}
    assert slurm_as_torchrun(srun, port=29500) == {
        "MASTER_ADDR": "gpu07", "MASTER_PORT": "29500", "WORLD_SIZE": "8", "RANK": "5",
        "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    # without --distributed-port every rank derives the same port from the job id
    assert slurm_as_torchrun(srun, port=-1)["MASTER_PORT"] == str(20000 + 4242)
    # torchrun under srun: its own variables win; one task per node with several GPUs is
    # fairseq's own Slurm mode (it spawns a process per GPU); a single task is no job
    assert slurm_as_torchrun(dict(srun, MASTER_ADDR="a", MASTER_PORT="1", WORLD_SIZE="8",
                                  RANK="5"), port=1) == {}
    one_per_node = dict(srun, SLURM_TASKS_PER_NODE="1(x8)")
    assert slurm_as_torchrun(one_per_node, port=1, cuda_devices=8) == {}
    assert slurm_as_torchrun(one_per_node, port=1)["LOCAL_WORLD_SIZE"] == "1"
    assert slurm_as_torchrun(dict(srun, SLURM_NTASKS="1"), port=1) == {}


SRUN = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
        "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_TASKS_PER_NODE": "2(x4)",
        "SLURM_JOB_ID": "4242"}


@pytest.mark.parametrize(("variable", "value", "expected"), [
    ("SLURM_JOB_NODELIST", "gpu[07", "is not a list of hosts (such as gpu[07-09,12],cpu1)"),
    ("SLURM_JOB_NODELIST", "gpu07]", "is not a list of hosts"),
    ("SLURM_JOB_NODELIST", "gpu[a-b]", "is not a list of hosts"),
    ("SLURM_JOB_NODELIST", "", "is not a list of hosts"),
    ("SLURM_STEP_NODELIST", "[],cpu1", "is not a list of hosts"),
    ("SLURM_NODEID", "x", "is not a number (this node's index in the job)"),
    ("SLURM_NODEID", "-1", "is not a number (this node's index in the job)"),
    ("SLURM_NTASKS", "eight", "is not a number (the job step's tasks)"),
    ("SLURM_PROCID", "5.0", "is not a number (this task's rank)"),
    ("SLURM_LOCALID", "", "is not a number (this task's rank on its node)"),
    ("SLURM_JOB_ID", "42_7", "is not a number (the job's id)"),
    ("SLURM_TASKS_PER_NODE", "2(x", "is not a list of task counts per node (such as 2(x3),1)"),
    ("SLURM_STEP_TASKS_PER_NODE", "two", "is not a list of task counts per node"),
])
def test_a_malformed_slurm_variable_is_named_in_one_line(
    variable: str, value: str, expected: str,
) -> None:
    """Not a ValueError's traceback (``not enough values to unpack``, ``invalid literal for
    int()``) on every rank: the variable, its value and what it should hold."""
    with pytest.raises(ShardingConfigError) as refused:
        slurm_as_torchrun(dict(SRUN, **{variable: value}), port=-1)
    assert str(refused.value).startswith(f"Slurm's {variable}={value} {expected}")
    assert str(refused.value).endswith(": launch with srun inside the job allocation, or "
                                       "set the torchrun variables yourself")
    assert "\n" not in str(refused.value)


def test_meter_leaves_host_side_storages_out_of_the_device_peak() -> None:
    shard = torch.zeros(1000)  # 4,000 B, offloaded from the start
    with LiveTensorMeter([], host=[shard]) as meter:
        activation = torch.ones(2000)  # 8,000 B on the device
        grad = activation[:500] * 2  # 2,000 B, reduced, then copied to the host
        meter.mark_host(grad)
        del activation
        meter.host_phase = True  # an optimizer step on the host
        state = torch.zeros_like(shard)
        meter.host_phase = False
    # the allocator also sees a few scalar-sized buffers of its own (under 64 bytes each)
    assert 14000 <= meter.peak_bytes < 14000 + 256  # before the activation was freed
    assert 8000 + 2000 <= meter.device_peak_bytes < 10000 + 256
    assert 4000 + 2000 + 4000 <= meter.host_bytes < 10000 + 256
    del state  # alive until the meter closed: its 4,000 B are counted on the host


def test_offload_watcher_follows_a_replaced_probe() -> None:
    """The benchmark swaps the trainer's probe for one with another meter after the trainer
    set up its offload watcher: reduced gradients and the optimizer step's allocations must
    still leave the new probe's device peak."""
    holder = {"probe": StepMemoryProbe(torch.device("cpu"))}
    param = torch.nn.Parameter(torch.zeros(1000))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)  # momentum: 4,000 B
    handles = watch_offloaded_state(lambda: holder["probe"], [param])
    try:
        probe = holder["probe"] = StepMemoryProbe(torch.device("cpu"))  # replaced
        probe.start([], host=[param])
        (param * 2.0).sum().backward()  # an activation, then the gradient (4,000 B each)
        optimizer.step()
        step = probe.stop()
    finally:
        for handle in handles:
            handle.remove()
    assert step is not None
    assert step.peak_allocated >= 4000 + 4000 + 4000  # the parameter, gradient, momentum
    assert step.peak_device < 4000 + 256  # the activation alone: the rest is on the host
