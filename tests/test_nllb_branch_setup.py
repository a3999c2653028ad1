"""``fairseq-shard-prepare-nllb-branch``: the Python 3.11 rewrite of the nllb branch's
dataclass defaults (on a crafted module, and on the branch's real files where the fairseq
mirror is on this machine) and the console script's dry run and one-line refusals. No pip,
no network: seconds."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fairseq_shard_plugin.cli.nllb_branch import PROG, rewrite_checkout, rewrite_source

REPO = Path(__file__).resolve().parents[1]
MIRROR = Path("/work/.mirror/facebookresearch+fairseq/repo")
COMMIT = "ec0ae71a"

CRAFTED = '''\
import dataclasses
from dataclasses import dataclass
from pathlib import Path


@dataclass
class InnerConfig:
    size: int = 3


@dataclass
class OuterConfig:
    inner: InnerConfig = InnerConfig()
    noise: InnerConfig = dataclasses.field(default=InnerConfig(), metadata={"help": "kept"})
    where: Path = Path()
    count: int = int()


class NotADataclass:
    inner: InnerConfig = InnerConfig()
'''


def _config_defaults(source: str) -> list[str]:
    """Every dataclass field whose default is (or whose ``field(default=...)`` is) a call of
    a ``...Config`` class: what Python 3.11 rejects."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ClassDef) and any(
                "dataclass" in ast.unparse(d) for d in node.decorator_list)):
            continue
        for statement in node.body:
            if not isinstance(statement, ast.AnnAssign) or statement.value is None:
                continue
            values = [statement.value]
            if isinstance(statement.value, ast.Call):
                values += [k.value for k in statement.value.keywords if k.arg == "default"]
            found += [ast.unparse(statement) for value in values
                      if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("Config")]
    return found


def _import(path: Path) -> object:
    spec = importlib.util.spec_from_file_location(f"crafted_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_crafted_module_imports_after_rewrite(tmp_path: Path) -> None:
    path = tmp_path / "crafted.py"
    path.write_text(CRAFTED)
    with pytest.raises(ValueError, match="mutable default"):
        _import(path)

    rewritten = rewrite_source(CRAFTED)
    path.write_text(rewritten)
    module = _import(path)

    assert module.OuterConfig.__dataclass_fields__["inner"].default is module.InnerConfig
    noise = module.OuterConfig.__dataclass_fields__["noise"]
    assert noise.default is module.InnerConfig and noise.metadata == {"help": "kept"}
    assert "from dataclasses import dataclass, field\n" in rewritten
    assert "    where: Path = Path()\n" in rewritten  # hashable: left alone
    assert "    count: int = int()\n" in rewritten
    assert "class NotADataclass:\n    inner: InnerConfig = InnerConfig()\n" in rewritten
    assert _config_defaults(rewritten) == []
    assert rewrite_source(rewritten) == rewritten  # idempotent


def test_rewrite_keeps_line_endings(tmp_path: Path) -> None:
    source = CRAFTED.replace("\n", "\r\n")
    rewritten = rewrite_source(source)
    assert rewritten.count("\r\n") == source.count("\r\n")
    assert "inner: InnerConfig = field(default=InnerConfig)\r\n" in rewritten


def _branch_files(destination: Path) -> list[str]:
    """Extract, from the mirror at COMMIT, every file of the package and examples that has
    a ``Config()`` in it; their paths."""
    if shutil.which("git") is None or not MIRROR.is_dir():
        pytest.skip(f"no fairseq mirror at {MIRROR} (or no git): the branch's real files "
                    "cannot be extracted here")
    git = ["git", f"--git-dir={MIRROR}"]
    listed = subprocess.run([*git, "grep", "-l", "Config()", COMMIT, "--", "fairseq",
                             "fairseq_cli", "examples"], capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"the mirror at {MIRROR} lacks commit {COMMIT} of the nllb branch")
    paths = [line.split(":", 1)[1] for line in listed.stdout.splitlines() if line.endswith(".py")]
    for relative in paths:
        content = subprocess.run([*git, "show", f"{COMMIT}:{relative}"], capture_output=True,
                                 check=True).stdout
        (destination / relative).parent.mkdir(parents=True, exist_ok=True)
        (destination / relative).write_bytes(content)
    return paths


def test_real_branch_files_rewrite(tmp_path: Path) -> None:
    paths = _branch_files(tmp_path)
    originals = {path: (tmp_path / path).read_text() for path in paths}
    assert _config_defaults(originals["fairseq/dataclass/configs.py"])

    changed = {str(path.relative_to(tmp_path)) for path in rewrite_checkout(tmp_path)}

    assert {"fairseq/dataclass/configs.py",
            "fairseq/models/transformer/transformer_config.py",
            "examples/nllb/modeling/train/train_script.py"} <= changed
    for path, original in originals.items():
        rewritten = (tmp_path / path).read_text()
        assert _config_defaults(rewritten) == [], path
        before, after = original.splitlines(), rewritten.splitlines()
        assert len(before) == len(after), path
        for old, new in zip(before, after, strict=True):  # nothing else is touched
            assert old == new or "Config()" in old or old.startswith("from dataclasses"), path
    configs = (tmp_path / "fairseq/dataclass/configs.py").read_text()
    assert "    common: CommonConfig = field(default=CommonConfig)\n" in configs
    transformer = (tmp_path / "fairseq/models/transformer/transformer_config.py").read_text()
    assert "quant_noise: QuantNoiseConfig = field(default=QuantNoiseConfig)\n" in transformer

    snapshot = {path: (tmp_path / path).read_bytes() for path in paths}
    assert rewrite_checkout(tmp_path) == []  # idempotent
    assert snapshot == {path: (tmp_path / path).read_bytes() for path in paths}


def _run(*arguments: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "fairseq_shard_plugin.cli.nllb_branch",
                           *arguments], capture_output=True, text=True, env=environment,
                          timeout=120)


def _fake_branch(root: Path) -> Path:
    for relative in ("fairseq/__init__.py", "fairseq/dataclass/configs.py", "setup.py",
                     "examples/nllb/README.md"):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text("")
    (root / "fairseq/dataclass/configs.py").write_text(CRAFTED)
    return root


def test_dry_run_prints_the_pip_commands(tmp_path: Path) -> None:
    branch = _fake_branch(tmp_path / "branch")
    result = _run(str(branch), "--python", sys.executable, "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "rewrote dataclass defaults in fairseq/dataclass/configs.py" in lines
    pip = f"{sys.executable} -m pip install"
    assert any(line.startswith(f"{pip} hydra-core==1.3.2 omegaconf==2.3.0 'numpy<1.24'")
               for line in lines), lines
    assert f"{pip} --no-deps fairscale==0.4.13" in lines
    assert f"{pip} --no-deps --no-build-isolation -e {branch.resolve()}" in lines
    assert "field(default=InnerConfig)" in (branch / "fairseq/dataclass/configs.py").read_text()

    again = _run(str(branch), "--python", sys.executable, "--dry-run")
    assert "dataclass defaults: nothing to rewrite" in again.stdout.splitlines()


@pytest.mark.parametrize("case", ["not_the_branch", "no_python"])
def test_failures_are_one_line(tmp_path: Path, case: str) -> None:
    if case == "not_the_branch":
        (tmp_path / "fairseq").mkdir()
        result = _run(str(tmp_path), "--dry-run")
        expected = "is not a checkout of fairseq's nllb branch"
    else:
        result = _run(str(_fake_branch(tmp_path)), "--python", str(tmp_path / "nopython"),
                      "--dry-run")
        expected = "pass --python"
    assert result.returncode == 1
    assert result.stdout.count("\n") <= 1 and "pip" not in result.stdout
    [line] = result.stderr.splitlines()
    assert line.startswith(f"{PROG}: error: ") and expected in line, line
