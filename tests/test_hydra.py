"""fairseq-hydra-train with the plugin's configs and command-line overrides."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fairseq_shard_plugin.sharding.options import ShardingConfig
from launching.harness import (
    PLUGIN_DIR,
    REPO,
    free_port,
    parse_logs,
    run_command,
    run_concurrently,
    run_like_srun,
    tool,
)

from tiny_training import ON_NLLB_BRANCH

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)

CONFIGS = REPO / "configs" / "nllb"
# the nllb branch starts NCCL before a plugin that comes without the callback is imported
WITHOUT_CALLBACK_ON_CPU = ["distributed_training.distributed_backend=gloo"] if ON_NLLB_BRANCH \
    else []


def hydra_command(config: str, *overrides: str) -> list[str]:
    """fairseq-hydra-train with one of the plugin's configs, the plugin as user dir."""
    return [tool("fairseq-hydra-train"), "--config-dir", str(CONFIGS), "--config-name", config,
            f"common.user_dir={PLUGIN_DIR}", *overrides]


def hydra_train(nproc: int, config: str, *overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [tool("torchrun"), "--nproc_per_node", str(nproc), "--master_port",
               str(free_port()), *hydra_command(config, *overrides)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_tiny_config_trains_on_two_cpu_ranks_with_overrides(corpus: Path, tmp_path: Path) -> None:
    # without the plugin's Hydra callback, as a config of the user's own: the plugin arrives
    # with common.user_dir only, and each rank joins torchrun's process group in the trainer
    completed = hydra_train(2, "tiny", f"task.data={corpus}", "optimization.max_update=15",
                            "common.log_format=json", "dataset.max_tokens=400",
                            "task.keep_root_gathered=true", "~hydra.callbacks.fairseq_shard_plugin",
                            *WITHOUT_CALLBACK_ON_CPU, cwd=tmp_path)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    assert "sharded over 2 ranks with fsdp2" in output
    # Hydra's deprecation warnings about the plugin's own configs (fairseq's are fairseq's)
    for warned in ("deprecated keyword in package header",
                   "will no longer change working directory"):
        assert warned not in output, output[:4000]
    assert "returned a view tensor" not in output  # the tied vocabulary unit's: harmless
    # the estimator's view of the run comes from the composed config with its overrides
    predicted = [line for line in output.splitlines() if "predicted peak: " in line]
    assert len(predicted) == 1 and "--max-tokens 400 " in predicted[0]
    assert "--keep-root-gathered" in predicted[0] and "--encoder-embed-dim 64 " in predicted[0]
    losses = [float(entry["loss"]) for entry in parse_logs(output)["train_inner"]]
    assert len(losses) == 15 and losses[-1] < losses[0] - 1.0


DENSE = ["dense_600m", "dense_1_3b", "dense_3_3b"]
FINETUNE = ["finetune_600m", "finetune_1_3b", "finetune_3_3b"]
# a smaller model of the same family, as a user tries a config first: no key needs `+`
SHRUNK = ["model.encoder_layers=2", "model.decoder_layers=2", "model.encoder_embed_dim=64"]
SIZE_KEYS = ("encoder_layers", "decoder_layers", "encoder_embed_dim", "decoder_embed_dim",
             "encoder_ffn_embed_dim", "decoder_ffn_embed_dim", "encoder_attention_heads",
             "decoder_attention_heads")


@pytest.fixture(scope="module")
def composed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """``--cfg job`` of each dense config, composed concurrently."""
    return run_concurrently(
        {config: hydra_command(config, "task.data=/data/nllb", *SHRUNK, "--cfg", "job")
         for config in DENSE}, cwd=tmp_path_factory.mktemp("compose"))


@pytest.mark.parametrize("config", DENSE)
def test_dense_configs_compose(
    config: str, composed: dict[str, subprocess.CompletedProcess]
) -> None:
    completed = composed[config]
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert f"_name: nllb_{config}" in completed.stdout
    assert "ddp_backend: fully_sharded" in completed.stdout
    job = OmegaConf.create(completed.stdout)
    assert (job.model.encoder_layers, job.model.encoder_embed_dim) == (2, 64)


@pytest.mark.parametrize("config", [*DENSE, *FINETUNE])
def test_the_listed_sizes_are_the_architectures_own(config: str) -> None:
    """The configs list the architecture's sizes (for overrides without `+`): the values
    its registered function sets, so listing them changes no model."""
    from fairseq.models import ARCH_CONFIG_REGISTRY

    from fairseq_shard_plugin.tasks import register

    register()
    model = OmegaConf.load(CONFIGS / f"{config}.yaml").model
    built = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[model._name](built)
    assert {key: model[key] for key in SIZE_KEYS} == {key: getattr(built, key)
                                                      for key in SIZE_KEYS}


RELEASED = "/models/nllb-200/checkpoint.pt"


@pytest.fixture(scope="module")
def composed_finetune(
    tmp_path_factory: pytest.TempPathFactory
) -> dict[str, subprocess.CompletedProcess]:
    """``--cfg job --resolve`` of each fine-tuning config with the checkpoint given, and of
    one without it (composed concurrently; nothing is trained)."""
    unset = ["env", "-u", "FINETUNE_FROM_MODEL"]
    commands = {config: [*unset, *hydra_command(
        config, "task.data=/data/nllb", f"checkpoint.finetune_from_model={RELEASED}",
        *SHRUNK, "--cfg", "job", "--resolve")] for config in FINETUNE}
    commands["not given"] = [*unset, *hydra_command(
        "finetune_600m", "task.data=/data/nllb", "--cfg", "job", "--resolve")]
    commands["one gpu"] = [*unset, *hydra_command(
        "finetune_3_3b_1gpu", "task.data=/data/nllb",
        f"checkpoint.finetune_from_model={RELEASED}", "--cfg", "job", "--resolve")]
    return run_concurrently(commands, cwd=tmp_path_factory.mktemp("compose_finetune"))


def test_the_one_gpu_config_is_the_3_3b_finetuning_with_its_state_on_the_host(
    composed_finetune: dict[str, subprocess.CompletedProcess]
) -> None:
    completed = composed_finetune["one gpu"]
    assert completed.returncode == 0, completed.stderr[-3000:]
    job = OmegaConf.create(completed.stdout)
    assert job.model._name == "nllb_dense_3_3b" and list(job.optimization.lr) == [5e-05]
    assert job.checkpoint.finetune_from_model == RELEASED
    dist = job.distributed_training
    assert dist.cpu_offload and dist.distributed_world_size == 1
    assert job.common.memory_efficient_fp16 and job.optimizer.fp16_adam_stats
    assert job.model.checkpoint_activations
    assert job.criterion._name == "chunked_label_smoothed_cross_entropy"
    assert job.task.checkpoint_format == "sharded"
    assert job.dataset.max_tokens == 4096 and list(job.optimization.update_freq) == [4]


@pytest.mark.parametrize("config", FINETUNE)
def test_finetune_configs_compose_with_the_recipes_finetuning_values(
    config: str, composed_finetune: dict[str, subprocess.CompletedProcess]
) -> None:
    completed = composed_finetune[config]
    assert completed.returncode == 0, completed.stderr[-3000:]
    job = OmegaConf.create(completed.stdout)
    # nllb200_dense3.3B_finetune_on_fbseed.yaml on fairseq's nllb branch
    assert list(job.optimization.lr) == [5e-05]
    assert job.lr_scheduler._name == "inverse_sqrt" and job.lr_scheduler.warmup_updates == 10
    assert job.optimization.max_update == 50 and list(job.optimization.update_freq) == [1]
    assert job.checkpoint.finetune_from_model == RELEASED
    # finetune_from_model resets these itself; fairseq refuses them beside it
    assert not any(job.checkpoint[f"reset_{part}"]
                   for part in ("optimizer", "lr_scheduler", "meters", "dataloader"))
    assert job.model._name == "nllb_" + config.replace("finetune", "dense")
    assert (job.model.encoder_layers, job.model.encoder_embed_dim) == (2, 64)  # no `+`
    assert job.task._name == "sharded_translation_multi_simple_epoch"
    assert job.task.add_data_source_prefix_tags is True
    assert job.distributed_training.ddp_backend == "fully_sharded"


def test_finetune_config_needs_the_checkpoint(
    composed_finetune: dict[str, subprocess.CompletedProcess]
) -> None:
    """Without checkpoint.finetune_from_model the config does not resolve, and
    fairseq-hydra-train resolves it before launching anything (a plain ``???`` would not
    do: fairseq's schema default, None, survives it and training would start from scratch)."""
    completed = composed_finetune["not given"]
    assert completed.returncode != 0
    assert "Environment variable 'FINETUNE_FROM_MODEL' not found" in completed.stderr


@pytest.mark.parametrize("config", [*DENSE, *FINETUNE, "tiny"])
def test_every_plugin_option_is_listed_in_the_configs(config: str) -> None:
    """Keys absent from a config need Hydra's ``+`` to override: every config lists all."""
    listed = OmegaConf.load(CONFIGS / f"{config}.yaml").task
    options = {option.name for option in fields(ShardingConfig)}
    assert options <= set(listed), options - set(listed)


@pytest.mark.parametrize("override, line", [
    ("task.shard_engine=deepspeed",
     "task.shard_engine: Invalid value 'deepspeed', expected one of [fsdp2, fairscale]"),
    ("task.layers_per_unit=abc",
     "task.layers_per_unit: Value 'abc' of type 'str' could not be converted to Integer"),
    # omegaconf's ConfigKeyError traceback (a typo with +, or in a copied YAML)
    ("+task.shard_enigne=fsdp2",
     "task.shard_enigne: not an option of task sharded_translation: did you mean "
     "task.shard_engine?"),
    # fairseq's fixed groups take any key Hydra's + adds: a typo trained on unsaid (T1 #2)
    ("+optimization.max_updates=3",
     "optimization.max_updates: not an option of fairseq's optimization: did you mean "
     "optimization.max_update?"),
    ("+checkpoint.no_such_key=1", "checkpoint.no_such_key: not an option of fairseq's "
     "checkpoint"),
    # a misspelt group, a key without its group (T4 #3)
    ("+optimisation.max_update=3",
     "optimisation: not a group of fairseq's config: did you mean optimization?"),
    ("+max_update=3",
     "max_update: not a group of fairseq's config: did you mean optimization.max_update?"),
    ("criterion.loss_chunk_tokens=abc",  # the callback checked task.* only
     "criterion.loss_chunk_tokens: Value 'abc' of type 'str' could not be converted to "
     "Integer"),
    # the plugin's checks before training name fairseq-train's flags: written as the keys
    ("task.layers_per_unit=0",
     "task.layers_per_unit=0: give 1 (every layer its own unit) or more"),
    # tiny.yaml's no_save: only the key set is named (the line named both, twice, T1 #6)
    ("task.export_consolidated=model.pt",
     "task.export_consolidated exports the final checkpoint_last.pt, which "
     "checkpoint.no_save leaves unwritten: remove it (false under Hydra), or the export"),
    ("common.amp=true",
     "common.amp is not supported with distributed_training.ddp_backend fully_sharded: use "
     "common.fp16 or common.bf16"),
    ("distributed_training.distributed_world_size=2",  # the launcher of this command
     "2 CPU ranks need a launcher: run `torchrun --nproc_per_node 2 "
     "$(which fairseq-hydra-train) ...` instead of "
     "distributed_training.distributed_world_size"),
    ("task._name=translation",  # stock's task to compare, the config's plugin keys kept
     "task.shard_engine: not an option of task translation: an option of the plugin's "
     "tasks, not of translation (task._name=sharded_translation or "
     "sharded_translation_multi_simple_epoch carries it)")])
def test_a_bad_task_value_from_a_hydra_override_is_one_line(
    corpus: Path, tmp_path: Path, override: str, line: str
) -> None:
    """The plugin's callback checks task.* against the task's dataclass before the job:
    fairseq's merge of the task's defaults stopped on it with omegaconf's traceback."""
    completed = subprocess.run(hydra_command("tiny", f"task.data={corpus}", override),
                               capture_output=True, text=True, timeout=300, cwd=tmp_path,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert completed.returncode != 0
    assert completed.stderr.strip().splitlines()[-1] == f"fairseq-shard-plugin: error: {line}"
    assert "Traceback" not in completed.stderr, completed.stderr[-3000:]


def test_a_user_dir_that_is_another_copy_of_the_plugin_is_named(
    corpus: Path, tmp_path: Path
) -> None:
    """The Hydra callback loads the plugin before fairseq reads common.user_dir, and fairseq
    skips a module name imported before: a patched copy given there did not run, unsaid."""
    fork = tmp_path / "fork" / "fairseq_shard_plugin"
    shutil.copytree(PLUGIN_DIR, fork, ignore=shutil.ignore_patterns("__pycache__"))
    command = hydra_command("tiny", f"task.data={corpus}", "optimization.max_update=1")
    command[command.index(f"common.user_dir={PLUGIN_DIR}")] = f"common.user_dir={fork}"
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300,
                               cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert (f"--user-dir {fork} (common.user_dir) is another copy of the plugin: the plugin "
            f"already loaded (installed, or imported by the Hydra callback) runs, from "
            f"{PLUGIN_DIR}") in completed.stderr + completed.stdout


def multilingual_overrides(data: Path) -> list[str]:
    pivot, *others = (data / "langs.txt").read_text().split()
    pairs = ",".join([f"{pivot}-{o}" for o in others] + [f"{o}-{pivot}" for o in others])
    return ["+corpus=multilingual", f"task.data={data}", f"task.lang_pairs='{pairs}'",
            f"task.lang_dict={data / 'langs.txt'}"]


@pytest.fixture(scope="module")
def multilingual_run(multilingual: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The NLLB recipe's task through fairseq-hydra-train (+corpus=multilingual) on 2 ranks:
    20 updates, a checkpoint every 10, the final model exported."""
    out = tmp_path_factory.mktemp("multilingual_run")
    completed = hydra_train(2, "tiny", *multilingual_overrides(multilingual),
                            "optimization.max_update=20", "common.log_format=json",
                            "checkpoint.no_save=false", "checkpoint.save_interval_updates=10",
                            f"checkpoint.save_dir={out / 'save'}",
                            f"task.export_consolidated={out / 'export.pt'}", cwd=out)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    losses = [float(entry["loss"]) for entry in parse_logs(output)["train_inner"]]
    return {"output": output, "losses": losses, "out": out}


def test_nllb_multilingual_task_trains_under_hydra(multilingual_run: dict) -> None:
    assert "main:eng_Latn-deu_Latn src_langtok" in multilingual_run["output"]  # every direction
    losses = multilingual_run["losses"]
    assert len(losses) == 20 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0


def test_nllb_multilingual_run_resumes_exactly_under_slurm(
    multilingual: Path, multilingual_run: dict, tmp_path: Path
) -> None:
    """Resumed from its update-10 checkpoint by 2 ranks started the way srun starts them
    (Slurm's variables, no torchrun), the run repeats updates 11-20 exactly: the same
    2-rank job, and the multilingual task's own sampling and data position restored."""
    checkpoint = multilingual_run["out"] / "save" / "checkpoint_1_10.pt"
    command = hydra_command("tiny", *multilingual_overrides(multilingual),
                            "optimization.max_update=20", "common.log_format=json",
                            "checkpoint.no_save=true", f"checkpoint.restore_file={checkpoint}",
                            f"distributed_training.distributed_port={free_port()}")
    first_rank, _ = run_like_srun(command, ranks=2, cwd=tmp_path)
    assert "over 2 ranks" in first_rank
    resumed = [float(entry["loss"]) for entry in parse_logs(first_rank)["train_inner"]]
    assert resumed == multilingual_run["losses"][10:]


def test_nllb_multilingual_export_translates(multilingual: Path, multilingual_run: dict) -> None:
    """The end-of-training export, read by fairseq-generate in one direction."""
    export = multilingual_run["out"] / "export.pt"
    generated = run_command(
        [tool("fairseq-generate"), str(multilingual), "--path", str(export), "--cpu",
         "--user-dir", str(PLUGIN_DIR), "--task", "sharded_translation_multi_simple_epoch",
         "--lang-pairs", "eng_Latn-fra_Latn", "--lang-dict", str(multilingual / "langs.txt"),
         "--source-lang", "eng_Latn", "--target-lang", "fra_Latn", "--encoder-langtok", "src",
         "--decoder-langtok", "--gen-subset", "valid", "--beam", "2", "--max-tokens", "1000"])
    assert generated.returncode == 0, generated.stderr[-3000:]
    translated = re.search(r"Translated (\d+) sentences", generated.stdout + generated.stderr)
    hypotheses = sum(line.startswith("H-") for line in generated.stdout.splitlines())
    assert translated and hypotheses == int(translated.group(1)) > 40  # of 50
    # the export's note gives stock fairseq-generate the settings (T3 #6: without them it
    # wrote German for eng-fra, silently); a process that never imports the plugin
    note = re.search(r"translates this multilingual model as trained only with its language "
                     r"settings, (.+?) \(and --lang-pairs", multilingual_run["output"])
    assert note, multilingual_run["output"][-3000:]
    stock = run_command(
        [tool("fairseq-generate"), str(multilingual), "--path", str(export), "--cpu",
         *note.group(1).split(), "--lang-pairs", "eng_Latn-fra_Latn", "--source-lang",
         "eng_Latn", "--target-lang", "fra_Latn", "--gen-subset", "valid", "--beam", "2",
         "--max-tokens", "1000"])
    assert stock.returncode == 0, stock.stderr[-3000:]
    assert "fairseq_shard_plugin" not in stock.stdout + stock.stderr
    assert sorted(line for line in stock.stdout.splitlines() if line.startswith("H-")) == sorted(
        line for line in generated.stdout.splitlines() if line.startswith("H-"))


def test_export_without_the_plugins_hydra_callback_is_refused_before_training(
    multilingual: Path, tmp_path: Path
) -> None:
    """Without the callback, fairseq-hydra-train loads the plugin too late for the export."""
    completed = hydra_train(1, "tiny", *multilingual_overrides(multilingual),
                            "~hydra.callbacks.fairseq_shard_plugin", "checkpoint.no_save=false",
                            "task.export_consolidated=out.pt", *WITHOUT_CALLBACK_ON_CPU,
                            cwd=tmp_path)
    output = completed.stdout + completed.stderr
    assert completed.returncode != 0
    assert "task.export_consolidated: fairseq-hydra-train loaded the plugin too late" in output
    assert "train_inner" not in output and not (tmp_path / "out.pt").exists()


def test_a_finetune_run_without_its_checkpoint_stops_in_one_line(tmp_path: Path) -> None:
    """The real command, not only the composed config: the plugin's Hydra callback resolves
    the job's config first and names the key, instead of omegaconf's traceback."""
    completed = run_command(["env", "-u", "FINETUNE_FROM_MODEL", *hydra_command(
        "finetune_600m", f"task.data={tmp_path}")], cwd=tmp_path)
    assert completed.returncode != 0
    assert "Traceback" not in completed.stderr, completed.stderr[-3000:]
    assert completed.stderr.strip().splitlines()[-1] == (
        "fairseq-shard-plugin: error: checkpoint.finetune_from_model: KeyError raised while "
        "resolving interpolation: \"Environment variable 'FINETUNE_FROM_MODEL' not found\"; "
        "give it on the command line (checkpoint.finetune_from_model=...) or set what it "
        "refers to")


def test_flags_in_errors_are_named_by_the_group_that_owns_the_key() -> None:
    """fairseq interpolates common.seed into task.seed and optimization.lr into
    optimizer.lr: the line names the key to set; flags of no key stay as they are."""
    from fairseq_shard_plugin.hydra_keys import in_hydra_keys

    job = {"task": {"seed": 1, "layers_per_unit": 0, "_name": "sharded_translation"},
           "optimizer": {"lr": [0.1]}, "common": {"seed": 1}, "optimization": {"lr": [0.1]},
           "model": argparse.Namespace(share_all_embeddings=True),
           "criterion": {"_name": "chunked_label_smoothed_cross_entropy"}}
    assert in_hydra_keys(
        "--seed, --lr, --layers-per-unit 0 and --share-all-embeddings; torchrun "
        "--nproc_per_node 2, /data/a--seed, /data/--seed/x.pt, ./--lr", job) == (
        "common.seed, optimization.lr, task.layers_per_unit 0 and "
        "model.share_all_embeddings; torchrun --nproc_per_node 2, /data/a--seed, "
        "/data/--seed/x.pt, ./--lr")
    # a line opening with a flag and its value opens with the override as Hydra reads it
    assert in_hydra_keys("--layers-per-unit 0: give 1 or more", job) == (
        "task.layers_per_unit=0: give 1 or more")
    # the flags that choose a component name its group's _name (they stayed flags, T1 #6)
    assert in_hydra_keys("--criterion chunked is not supported with --arch x", job) == (
        "criterion._name chunked is not supported with model._name x")
