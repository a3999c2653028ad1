"""How the plugin's hooks go into fairseq (``integration.install``), each case in a fresh
Python process: the hooks replace module attributes of fairseq, which would otherwise
stay replaced for the rest of the test session."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import fairseq
import pytest

from fairseq_shard_plugin.sharding.settings import launcher_rank
from launching.harness import run_command

pytestmark = pytest.mark.e2e  # launches fairseq processes (make test-unit skips them)

REPO = Path(__file__).resolve().parents[1]
PLUGIN_DIR = REPO / "fairseq_shard_plugin"


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return run_command([sys.executable, "-c", textwrap.dedent(code)])


def test_a_foreign_functools_wraps_wrapper_is_wrapped_not_taken_for_the_plugins() -> None:
    """A profiler's (or another plugin's) ``functools.wraps`` wrapper has ``__wrapped__``
    too: the plugin still installs its hook over it, which calls through to it, and a
    second install wraps nothing twice."""
    result = run_python("""
        import functools
        import fairseq.checkpoint_utils as checkpoint_utils

        calls = []

        @functools.wraps(checkpoint_utils.load_checkpoint_to_cpu)
        def profiled(path, *args, **kwargs):
            calls.append(path)
            return {"model": {}, "read_by": "profiler"}

        checkpoint_utils.load_checkpoint_to_cpu = profiled
        assert hasattr(profiled, "__wrapped__")

        import fairseq_shard_plugin
        fairseq_shard_plugin.activate()
        from fairseq_shard_plugin import fairseq_integration as integration

        hook = checkpoint_utils.load_checkpoint_to_cpu
        assert hook is not profiled, "the plugin skipped its hook"
        assert getattr(hook, "_fairseq_shard_plugin_hook", None) is True, vars(hook)
        assert hook.__wrapped__ is profiled
        state = hook("/nowhere/checkpoint.pt")
        assert calls == ["/nowhere/checkpoint.pt"], calls
        assert state == {"model": {}, "read_by": "profiler"}, state

        integration.install()
        assert checkpoint_utils.load_checkpoint_to_cpu is hook, "wrapped twice"
        print("hooked over the profiler")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "hooked over the profiler"


@pytest.mark.parametrize(("break_it", "said"), [
    ("import fairseq.distributed.utils as m; del m.call_main",
     "missing fairseq.distributed.utils.call_main"),
    ("import fairseq_cli.train as m; m.validate_and_save = 42",
     "fairseq_cli.train.validate_and_save is not callable"),
    # names that are swapped or overridden rather than replaced: each would vanish silently
    ("import fairseq.models.transformer.transformer_encoder as m; del m.fsdp_wrap",
     "missing fairseq.models.transformer.transformer_encoder.fsdp_wrap"),
    ("import fairseq.trainer as m; del m.Trainer._reduce_and_log_stats",
     "missing fairseq.trainer.Trainer._reduce_and_log_stats"),
    ("import fairseq.trainer as m; del m.Trainer._build_optimizer",
     "missing fairseq.trainer.Trainer._build_optimizer"),
    ("import fairseq.checkpoint_utils as m; m.torch = None",
     "fairseq.checkpoint_utils does not use torch under that name"),
    ("import fairseq.checkpoint_utils as m; del m.torch",
     "fairseq.checkpoint_utils does not use torch under that name"),
    # hook 5 swaps the module's PathManager: its check used to stop in an AttributeError
    ("import fairseq.checkpoint_utils as m; del m.PathManager",
     "missing fairseq.checkpoint_utils.PathManager"),
    ("import fairseq.file_io as m; del m.PathManager.copy",
     "missing fairseq.checkpoint_utils.PathManager.copy"),
], ids=["missing", "not-callable", "layer-builder", "trainer-method", "trainer-optimizer",
        "checkpoint-torch", "checkpoint-without-torch", "checkpoint-path-manager",
        "path-manager-copy"])
def test_a_fairseq_without_a_hooked_function_fails_in_one_line_naming_its_version(
    break_it: str, said: str,
) -> None:
    """Loaded as fairseq loads a user dir (``--user-dir``): one line, no traceback."""
    result = run_python(f"""
        {break_it}
        from argparse import Namespace
        from fairseq import utils
        utils.import_user_module(Namespace(user_dir={str(PLUGIN_DIR)!r}))
    """)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("fairseq-shard-plugin: error: fairseq_shard_plugin does not "
                           f"support fairseq {fairseq.__version__}: "), last
    assert said in last, last


def test_importing_installs_nothing_loading_the_user_dir_installs_everything() -> None:
    """Importing a module of the plugin (here the pure-arithmetic memory model) leaves fairseq
    as it is; fairseq's own user-dir loading (``--user-dir``) activates the plugin."""
    result = run_python(f"""
        import sys
        from argparse import Namespace
        import fairseq.checkpoint_utils as checkpoint_utils
        import fairseq_cli.train as train_cli
        from fairseq import utils
        from fairseq.tasks import TASK_REGISTRY

        def hooked():
            return hasattr(checkpoint_utils.load_checkpoint_to_cpu, "_fairseq_shard_plugin_hook")

        import fairseq_shard_plugin.memory.model
        assert not hooked() and "sharded_translation" not in TASK_REGISTRY
        del sys.modules["fairseq_shard_plugin"]  # as if not imported: fairseq skips those
        utils.import_user_module(Namespace(user_dir={str(PLUGIN_DIR)!r}))
        assert hooked() and "sharded_translation" in TASK_REGISTRY
        assert getattr(train_cli, "_fairseq_shard_plugin_installed", False)
        print("installed by the user dir only")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "installed by the user dir only"


def test_fairseq_maps_the_checkpoints_it_loads(tmp_path: Path) -> None:
    """fairseq 0.12 reads a checkpoint through an open file, a private copy per process;
    under the plugin its loader maps a zip-format file (pages shared by a host's ranks) and
    still reads an old-format one; ``checkpoint_utils.torch`` is torch again afterwards."""
    result = run_python(f"""
        import torch
        import fairseq.checkpoint_utils as checkpoint_utils

        import fairseq_shard_plugin
        fairseq_shard_plugin.activate()

        def mapped(path):
            return any(line.rstrip().endswith(path) for line in open("/proc/self/maps"))

        zip_file, legacy = "{tmp_path}/zip.pt", "{tmp_path}/legacy.pt"
        state = {{"model": {{"w": torch.arange(4096.0)}}, "args": None, "cfg": None,
                  "optimizer_history": [{{"criterion_name": "CrossEntropyCriterion",
                                          "optimizer_name": "FairseqAdam",
                                          "lr_scheduler_state": {{"best": None}},
                                          "num_updates": 0}}],
                  "extra_state": {{"train_iterator": {{"epoch": 1}}}}}}
        torch.save(state, zip_file)
        torch.save(state, legacy, _use_new_zipfile_serialization=False)
        loaded = checkpoint_utils.load_checkpoint_to_cpu(zip_file)
        assert mapped(zip_file), "read, not mapped"
        assert torch.equal(loaded["model"]["w"], state["model"]["w"])
        del loaded
        old = checkpoint_utils.load_checkpoint_to_cpu(legacy)
        assert not mapped(legacy) and torch.equal(old["model"]["w"], state["model"]["w"])
        assert checkpoint_utils.torch is torch
        print("mapped")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "mapped"


def test_fconv_layer_specs_from_a_config_are_evaluated_as_data_only(tmp_path: Path) -> None:
    """fairseq's fconv builds its layers with ``eval`` of config strings, which a checkpoint
    carries: stock fairseq runs a crafted one; under the plugin only literals joined by
    + and * are evaluated, and anything else is refused in one line."""
    marker = tmp_path / "marker"
    result = run_python(f"""
        import argparse, os
        from types import SimpleNamespace
        from fairseq.data import Dictionary
        from fairseq.models import fconv

        task = SimpleNamespace(source_dictionary=Dictionary(), target_dictionary=Dictionary())

        def build(encoder_layers):
            args = argparse.Namespace(encoder_layers=encoder_layers)
            fconv.base_architecture(args)
            args.encoder_embed_dim = args.decoder_embed_dim = args.decoder_out_embed_dim = 8
            args.max_source_positions = args.max_target_positions = 64
            args.decoder_layers = "[(8, 3)] * 2"
            return fconv.FConvModel.build_model(args, task)

        crafted = "__import__('os').system('touch {marker}') or [(8, 3)]"
        build(crafted)  # stock fairseq: the string runs
        assert os.path.exists({str(marker)!r}), "the crafted spec did not run in stock fairseq"
        os.remove({str(marker)!r})

        import fairseq_shard_plugin
        fairseq_shard_plugin.activate()
        assert len(build("[(8, 3)] * 2 + [(8, 1)]").encoder.convolutions) == 3
        try:
            build(crafted)
        except ValueError as error:
            print(error)
        assert not os.path.exists({str(marker)!r}), "the crafted spec ran under the plugin"
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("the model config's layer spec \"__import__('os')"), line
    assert "holds boolop syntax: only literals joined by + and * are evaluated" in line, line


def test_only_the_launchers_rank_0_probes_the_save_dir(tmp_path: Path) -> None:
    """Hook 12: where every rank believes it is fairseq's master (the plugin loaded inside
    ``main``), only the rank the launcher numbered 0 creates and probes the save dir; the
    others' probes of the same ``dummy`` file no longer race with it."""
    result = run_python(f"""
        import os
        from argparse import Namespace
        from fairseq import checkpoint_utils, utils
        utils.import_user_module(Namespace(user_dir={str(PLUGIN_DIR)!r}))
        for rank in ("1", "0"):
            os.environ["RANK"] = rank
            checkpoint_utils.verify_checkpoint_directory({str(tmp_path)!r} + "/rank" + rank)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (tmp_path / "rank1").exists()
    assert (tmp_path / "rank0").is_dir() and not (tmp_path / "rank0" / "dummy").exists()
    assert launcher_rank({"SLURM_PROCID": "3"}) == 3
    assert launcher_rank({"RANK": "2", "SLURM_PROCID": "3"}) == 2 and launcher_rank({}) is None
