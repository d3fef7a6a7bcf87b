"""Every ``from pdserve|services|bench|tests... import name`` in the repository resolves, at module
level or inside a function. The GPU tests, the GPU benches and lazily imported paths do not run in
CI (no GPU): a name moved to another module would otherwise surface only on the lent GPU. Only
from-imports are checked (not attribute reads on an imported module, nor dotted strings)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pdserve", "services", "bench", "tests")


def _from_imports() -> list[tuple[str, int, str, str]]:
    """(file, line, module, name) of every absolute from-import of the repository's packages."""
    found = []
    for pkg in (*PACKAGES, "scripts"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    if node.module.split(".")[0] in PACKAGES:
                        rel = str(path.relative_to(ROOT))
                        found += [
                            (rel, node.lineno, node.module, a.name) for a in node.names if a.name != "*"
                        ]
    return found


def test_every_from_import_of_the_repository_resolves() -> None:
    imports = _from_imports()
    assert len(imports) > 1000  # the walk found the tree
    missing, unchecked = [], set()
    for rel, line, module, name in imports:
        try:
            mod = importlib.import_module(module)
        except pytest.skip.Exception:  # a test module that skips where a package is missing
            unchecked.add(module)
            continue
        if hasattr(mod, name):
            continue
        try:  # a submodule: from pdserve.engine import scheduler
            importlib.import_module(f"{module}.{name}")
        except ModuleNotFoundError:
            missing.append(f"{rel}:{line}: from {module} import {name}")
    assert not missing, "\n".join(missing)
    assert len(unchecked) < 5, f"modules that skipped at import, their imports unchecked: {unchecked}"
