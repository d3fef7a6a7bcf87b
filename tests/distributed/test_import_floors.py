"""``pdserve/distributed`` is a floor beneath ``pdserve/engine``: no import path leads from it
back up to the engine (an import inside a function counts too)."""

from __future__ import annotations

import ast
from pathlib import Path

PDSERVE = Path(__file__).resolve().parents[2] / "pdserve"


def _package_imports(root: Path = PDSERVE) -> dict[str, set[str]]:
    """pdserve's top-level packages (and modules) -> the other ones they import, anywhere in a file."""
    edges: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        src = parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.ImportFrom):  # relative: resolve against the file's package
                base = parts[: len(parts) - node.level]
                names = [".".join(("pdserve", *base, *([node.module] if node.module else [])))]
            else:
                continue
            for name in names:
                dst = name.split(".")[1] if name.startswith("pdserve.") else None
                if dst is not None and dst != src:
                    edges.setdefault(src, set()).add(dst)
    return edges


def _reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_distributed_imports_nothing_that_leads_to_the_engine() -> None:
    edges = _package_imports()
    assert "distributed" in edges.get("engine", set())  # the walk sees the engine's own imports
    below = _reachable(edges, "distributed")
    assert "engine" not in below, f"pdserve/distributed reaches the engine through {sorted(below)}"


def test_the_walk_finds_a_circle(tmp_path: Path) -> None:
    """The check fails on a circle: an import of the engine inside a function of distributed/."""
    (tmp_path / "distributed").mkdir()
    (tmp_path / "distributed" / "late.py").write_text(
        "def f():\n    from pdserve.engine.llm_engine import LLMEngine\n    return LLMEngine\n"
    )
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "core.py").write_text("from ..distributed import late\n")
    edges = _package_imports(tmp_path)
    assert edges == {"distributed": {"engine"}, "engine": {"distributed"}}
    assert "engine" in _reachable(edges, "distributed")
