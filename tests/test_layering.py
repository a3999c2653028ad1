"""The package's imports point one way (docs/architecture.md, "Module paths"): each part
imports only parts below it, so no import circle can form, at module level or inside a
function. Checked on the source, every ``from fairseq_shard_plugin.X`` import."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fairseq_shard_plugin"
# lowest first; a part may import its own and any lower layer's modules
LAYERS = [
    {"errors", "run_hooks", "hydra_keys", "torch_support"},
    {"sharding"}, {"checkpoint"}, {"tasks"}, {"memory"}, {"training"}, {"cli"},
    {"fairseq_integration", "hydra_callback"},
]


def _layer(part: str) -> int:
    return next(index for index, parts in enumerate(LAYERS) if part in parts)


def _imported_parts(path: Path) -> set[str]:
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                 else [alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [])
        for name in names:
            dotted = name.split(".")
            if dotted[0] == PACKAGE.name and len(dotted) > 1:  # the bare package: activate()
                parts.add(dotted[1])
    return parts


def test_every_import_of_the_package_points_down() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.name == "__init__.py" and len(relative.parts) == 1:
            continue  # the package itself: what loading the user dir does, above all
        part = relative.parts[0].removesuffix(".py")
        upward += [f"{relative} imports {target}" for target in _imported_parts(path)
                   if _layer(target) > _layer(part)]
    assert not upward, upward
