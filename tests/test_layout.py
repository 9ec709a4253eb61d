"""The shell's parts depend one way: no import cycle among gpud's modules, and only
the entry points import the server that wires the parts together."""

from __future__ import annotations

import ast
from pathlib import Path

GPUD = Path(__file__).resolve().parent.parent / "gpud"
# What may import gpud.server: the entry point, the listener it starts, the monitor it runs.
WIRING = {"gpud.main", "gpud.listener", "gpud.monitor"}


def imports_of(path: Path) -> set[str]:
    """Every gpud module ``path`` imports, anywhere in it (functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gpud"):
            if node.module == "gpud":  # from gpud import lockfile, systemd
                found |= {f"gpud.{a.name}" for a in node.names if (GPUD / f"{a.name}.py").exists()}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("gpud.")}
    return found


def graph() -> dict[str, set[str]]:
    modules = {f"gpud.{p.stem}": p for p in GPUD.glob("*.py") if p.stem != "__init__"}
    modules |= {f"gpud.core.{p.stem}": p for p in (GPUD / "core").glob("*.py") if p.stem != "__init__"}
    return {name: {m for m in imports_of(path) if m in modules} for name, path in modules.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_shell_has_no_import_cycle() -> None:
    assert cycle(graph()) is None, " -> ".join(cycle(graph()) or [])


def test_only_the_entry_points_import_the_server() -> None:
    importers = {name for name, deps in graph().items() if "gpud.server" in deps}
    assert importers <= WIRING, f"{sorted(importers - WIRING)} import gpud.server: give them the pieces they need"


def test_the_core_imports_nothing_of_the_shell() -> None:
    for name, deps in graph().items():
        if name.startswith("gpud.core."):
            assert all(d.startswith("gpud.core.") for d in deps), f"{name} imports {sorted(deps)}"


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
