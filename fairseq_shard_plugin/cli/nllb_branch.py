"""Turn a checkout of fairseq's ``nllb`` branch into a working environment beside the plugin.

``fairseq-shard-prepare-nllb-branch CHECKOUT [--python PYTHON] [--dry-run]``

The branch (commit ec0ae71a, on no package index) predates Python 3.11 and pins old
packages. This tool, in order:

1. checks that CHECKOUT is the branch (``fairseq/`` and ``examples/nllb``);
2. rewrites its dataclass defaults that Python 3.11 rejects as mutable, ``x: Foo = Foo()``
   and ``x: Foo = field(default=Foo())``, to ``field(default=Foo)`` (the class: fairseq's
   ``hydra_init`` reads ``.default``, so ``default_factory`` does not work), printing each
   file it changes; a second run changes nothing;
3. runs with PYTHON (or with ``--dry-run`` only prints) three pip commands: hydra-core 1.3.2,
   omegaconf 2.3.0 and ``numpy<1.24`` plus the runtime and build needs PYTHON lacks;
   fairscale 0.4.13 with ``--no-deps``; the checkout, editable, with ``--no-deps`` and
   ``--no-build-isolation`` (it compiles fairseq's Cython and C++ extensions against the
   installed numpy and torch). No command can replace torch: none resolves its pins.

Every failure ends in one line that says what to do.
"""

from __future__ import annotations

import argparse
import ast
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fairseq_shard_plugin.torch_support import torch_problem

PROG = "fairseq-shard-prepare-nllb-branch"

#: Paths only the nllb branch has, besides the ``fairseq`` package itself.
BRANCH_MARKERS = ("fairseq/__init__.py", "fairseq/dataclass/configs.py", "setup.py",
                  "examples/nllb")

#: Folders of the checkout whose Python files are rewritten (its own tests are left alone).
REWRITTEN_FOLDERS = ("fairseq", "fairseq_cli", "examples")

#: Always installed, in one command, so that nothing in it can bring numpy 2 back.
PINNED = ("hydra-core==1.3.2", "omegaconf==2.3.0", "numpy<1.24")

#: pip name -> module: what the branch imports (or builds with) and declares loosely.
NEEDED = {
    "bitarray": "bitarray",
    "regex": "regex",
    "sacrebleu": "sacrebleu",
    "sentencepiece": "sentencepiece",
    "tqdm": "tqdm",
    "cython": "Cython",
    "setuptools": "setuptools",
    "wheel": "wheel",
}

FAIRSCALE = "fairscale==0.4.13"

#: The folder to pass as ``--user-dir``.
PLUGIN = Path(__file__).resolve().parents[1]


class PrepareError(Exception):
    """A one-line reason the environment cannot be prepared, saying what to do."""


@dataclass(frozen=True)
class Edit:
    """Replace the source between two (line, column) positions by ``text``."""

    start: tuple[int, int]
    end: tuple[int, int]
    text: str


# --- the checkout ---------------------------------------------------------------------------


def check_checkout(checkout: Path) -> None:
    """Raise :class:`PrepareError` unless ``checkout`` looks like the nllb branch."""
    if not checkout.is_dir():
        raise PrepareError(f"{checkout} is not a directory: pass a checkout of fairseq's "
                           "nllb branch (git checkout ec0ae71a)")
    missing = [marker for marker in BRANCH_MARKERS if not (checkout / marker).exists()]
    if missing:
        raise PrepareError(f"{checkout} is not a checkout of fairseq's nllb branch (no "
                           f"{', '.join(missing)}): pass the branch's top folder "
                           "(git checkout ec0ae71a)")


# --- the dataclass rewrite ------------------------------------------------------------------


def _is_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return False


def _instance_of_annotation(value: ast.expr, annotation: str) -> ast.Call | None:
    """``value`` when it is ``FooConfig()`` and the field's type is ``FooConfig``: a default
    instance of a config dataclass (other calls, ``Path()`` say, may well be hashable)."""
    if (isinstance(value, ast.Call) and not value.args and not value.keywords
            and isinstance(value.func, ast.Name | ast.Attribute)
            and annotation.endswith("Config") and ast.unparse(value.func) == annotation):
        return value
    return None


def _field_edit(statement: ast.AnnAssign) -> Edit | None:
    """The edit that makes the default of one dataclass field hashable, if it needs one."""
    value = statement.value
    if value is None:
        return None
    annotation = ast.unparse(statement.annotation)
    call = _instance_of_annotation(value, annotation)
    if call is not None:  # x: Foo = Foo()
        return Edit((call.lineno, call.col_offset), (call.end_lineno, call.end_col_offset),
                    f"field(default={annotation})")
    if isinstance(value, ast.Call) and ast.unparse(value.func) in ("field", "dataclasses.field"):
        for keyword in value.keywords:  # x: Foo = field(default=Foo(), ...)
            call = _instance_of_annotation(keyword.value, annotation)
            if keyword.arg == "default" and call is not None:
                return Edit((call.lineno, call.col_offset),
                            (call.end_lineno, call.end_col_offset), annotation)
    return None


def _binds_field(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.ImportFrom) and node.module == "dataclasses"
               and any(alias.name == "field" and alias.asname is None for alias in node.names)
               for node in tree.body)


def _import_field_edit(tree: ast.Module) -> Edit | None:
    """Add ``field`` to the module's one-line ``from dataclasses import ...``."""
    for node in tree.body:
        if (isinstance(node, ast.ImportFrom) and node.module == "dataclasses"
                and node.lineno == node.end_lineno):
            names = [*node.names, ast.alias(name="field")]
            statement = ast.ImportFrom(module="dataclasses", names=names, level=0)
            return Edit((node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset),
                        ast.unparse(statement))
    return None


def field_edits(source: str) -> list[Edit]:
    """The edits that make every dataclass default of ``source`` acceptable to Python 3.11."""
    tree = ast.parse(source)
    edits = [edit for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
             and _is_dataclass(node) for statement in node.body
             if isinstance(statement, ast.AnnAssign)
             and (edit := _field_edit(statement)) is not None]
    needs_field = any(edit.text.startswith("field(") for edit in edits)
    if needs_field and not _binds_field(tree):
        import_edit = _import_field_edit(tree)
        if import_edit is None:
            raise PrepareError("cannot add `from dataclasses import field` here: rewrite "
                               "its `x: Foo = Foo()` defaults to `field(default=Foo)` by hand")
        edits.append(import_edit)
    return edits


def apply_edits(source: str, edits: Sequence[Edit]) -> str:
    """``source`` with ``edits`` (non-overlapping; columns in UTF-8 bytes, as ``ast``'s)."""
    lines = source.encode().splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    data = source.encode()
    for edit in sorted(edits, key=lambda edit: edit.start, reverse=True):
        start = offsets[edit.start[0] - 1] + edit.start[1]
        end = offsets[edit.end[0] - 1] + edit.end[1]
        data = data[:start] + edit.text.encode() + data[end:]
    return data.decode()


def rewrite_source(source: str) -> str:
    """``source`` with its mutable dataclass defaults rewritten; unchanged if it has none."""
    edits = field_edits(source)
    return apply_edits(source, edits) if edits else source


def rewrite_file(path: Path) -> bool:
    """Rewrite one file in place; True when it changed."""
    try:
        source = path.read_bytes().decode("utf-8")  # bytes: line endings stay as they are
        rewritten = rewrite_source(source) if "Config()" in source else source
    except (SyntaxError, UnicodeDecodeError):  # not Python 3 source: Python 3.11 cannot
        return False  # import it either way
    except PrepareError as error:
        raise PrepareError(f"{path}: {error}") from None
    if rewritten == source:
        return False
    path.write_bytes(rewritten.encode("utf-8"))
    return True


def rewrite_checkout(checkout: Path) -> list[Path]:
    """Rewrite every Python file of the checkout's package and examples; the changed ones."""
    changed = []
    for folder in REWRITTEN_FOLDERS:
        for path in sorted((checkout / folder).rglob("*.py")):
            if not path.is_file():  # the branch has dangling symlinks under examples/
                continue
            try:
                if rewrite_file(path):
                    changed.append(path)
            except OSError as error:
                raise PrepareError(f"cannot rewrite {path} ({error.strerror}): make the "
                                   "checkout writable and run again") from None
    return changed


# --- the installs ---------------------------------------------------------------------------


def _probe(python: str, code: str) -> str:
    """Run ``code`` with ``python``; its stdout, or a PrepareError naming what to do."""
    try:
        result = subprocess.run([python, "-c", code], capture_output=True, text=True,
                                check=False)
    except OSError as error:
        raise PrepareError(f"cannot run {python} ({error.strerror}): pass --python with the "
                           "interpreter of the environment to prepare") from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise PrepareError(f"{python} failed ({last}): pass --python with a working "
                           "interpreter of the environment to prepare")
    return result.stdout


def torch_version(python: str) -> str:
    """The torch that ``python`` imports, which no command here may replace."""
    output = _probe(python, "import importlib.util as u; print(u.find_spec('torch') and "
                    "__import__('torch').__version__)").strip()
    if output == "None":
        raise PrepareError(f"{python} has no torch: install torch into that environment "
                           "first (pip install torch), then run again")
    return output


def missing_packages(python: str) -> list[str]:
    """The pip names of :data:`NEEDED` whose module ``python`` cannot find."""
    modules = ",".join(repr(module) for module in NEEDED.values())
    code = ("import importlib.util as u; "
            f"print(' '.join(m for m in ({modules},) if u.find_spec(m) is None))")
    absent = set(_probe(python, code).split())
    return [name for name, module in NEEDED.items() if module in absent]


def pip_commands(python: str, checkout: Path, missing: Sequence[str]) -> list[list[str]]:
    """The three pip commands, in order."""
    pip = [python, "-m", "pip", "install"]
    return [
        [*pip, *PINNED, *missing],
        [*pip, "--no-deps", FAIRSCALE],
        [*pip, "--no-deps", "--no-build-isolation", "-e", str(checkout)],
    ]


def run_command(command: Sequence[str]) -> None:
    """Run one pip command with its output shown; a PrepareError if it fails."""
    print(f"$ {shlex.join(command)}", flush=True)
    if subprocess.run(command, check=False).returncode != 0:
        raise PrepareError(f"pip failed (above) on: {shlex.join(command)} -- fix what it "
                           "names and run this tool again (it is safe to rerun)")


def check_environment(python: str, torch_before: str) -> None:
    """Check that fairseq of the branch imports and that torch was left as it was."""
    after = torch_version(python)
    if after != torch_before:
        raise PrepareError(f"torch changed from {torch_before} to {after}: reinstall "
                           f"torch=={torch_before} with {python} -m pip")
    code = ("import fairseq, fairseq.models, fairseq.tasks, fairseq.data.data_utils_fast; "
            "from fairseq.dataclass.configs import FairseqConfig; print(fairseq.__file__)")
    try:
        print(f"fairseq imports from {Path(_probe(python, code).strip()).parent}")
    except PrepareError as error:
        raise PrepareError(f"the prepared fairseq does not import: {error}") from None


# --- the console script ---------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Make a checkout of fairseq's nllb branch (ec0ae71a) work "
        "on Python 3.11 and a current torch, and install it, editable, beside the plugin.")
    parser.add_argument("checkout", type=Path, help="top folder of the nllb branch checkout")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter of the environment to install into "
                        "(default: this one)")
    parser.add_argument("--dry-run", action="store_true",
                        help="rewrite the dataclass defaults but only print the pip commands")
    return parser.parse_args(argv)


def prepare(checkout: Path, python: str, dry_run: bool) -> None:
    """Everything the console script does; a PrepareError on the first failure."""
    check_checkout(checkout)
    torch_before = torch_version(python)
    problem = torch_problem(torch_before)
    if problem:  # before anything is rewritten or installed
        raise PrepareError(f"{python}: {problem}")
    changed = rewrite_checkout(checkout)
    for path in changed:
        print(f"rewrote dataclass defaults in {path.relative_to(checkout)}")
    if not changed:
        print("dataclass defaults: nothing to rewrite")
    commands = pip_commands(python, checkout.resolve(), missing_packages(python))
    if dry_run:
        for command in commands:
            print(shlex.join(command))
        return
    for command in commands:
        run_command(command)
    check_environment(python, torch_before)
    print("done. On torch >= 2.6 the branch loads its own checkpoints only with the plugin's "
          f"--user-dir (torch.load defaults to weights_only=True): pass --user-dir {PLUGIN} "
          "to fairseq-train, fairseq-generate and the rest.")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        prepare(args.checkout, args.python, args.dry_run)
    except PrepareError as error:
        sys.exit(f"{PROG}: error: {error}")
    except KeyboardInterrupt:
        sys.exit(f"{PROG}: error: interrupted: run it again (every step is safe to rerun)")


if __name__ == "__main__":
    main()
