"""The library under ``pdserve/`` imports nothing from ``services/``: the command line and the
nodes sit above it (services/cli.py starts them), never the other way round."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, at any depth (inside functions too)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def test_library_imports_nothing_from_services() -> None:
    files = sorted((ROOT / "pdserve").rglob("*.py"))
    assert len(files) > 50  # the walk found the library
    upward = [
        f"{p.relative_to(ROOT)}:{line}: {module}"
        for p in files
        for line, module in imports_of(p)
        if module == "services" or module.startswith("services.")
    ]
    assert upward == [], "the library imports the services layer:\n" + "\n".join(upward)


def test_the_walk_sees_imports_inside_functions(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from services.node import NodeBase\n    import services.cli as c\n")
    assert imports_of(src) == [(2, "services.node"), (3, "services.cli")]
