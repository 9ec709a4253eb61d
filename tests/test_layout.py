"""gpud's folders are its architecture, and their imports point one way.

The folders are layers, lowest first; each imports only the layers below it, with no exception:

- ``gpud/core``: the rules, pure; imports only the core.
- ``gpud/host``: what touches the host (config, GPUs, the store, the lock file, systemd,
  logs, metrics); imports the core and the protocol.
- ``gpud/kit``: the pieces every capability handler is given (the connections and the send path,
  effects, faults, access, GPU slots); imports the core and the host.
- ``gpud/capabilities``: one handler per capability; each imports the core, the host and the
  kit, never another capability.
- ``gpud/serving``: the runtime above the capabilities: the listener, connections, timers, the
  monitor, and the daemon (``server``), the one serving module that imports the capabilities.
- ``gpud/tools``: the daemon's clients (gpuctl, top, the demo), apart from the layers; they speak
  the protocol through ``gpud_client`` and import nothing else of gpud.
- ``gpud/main.py``: the entry point, which may import anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

GPUD = Path(__file__).resolve().parent.parent / "gpud"
# The layers, lowest first: a layer imports only the layers before it.
LAYERS = ("core", "host", "kit", "capabilities", "serving")
FOLDERS = {*LAYERS, "tools"}
# What each folder may import of gpud, besides itself (gpud_client is open to all).
MAY_IMPORT = {
    "core": set(),
    "host": {"core"},
    "kit": {"core", "host"},
    "capabilities": {"core", "host", "kit"},
    "serving": {"core", "host", "kit", "capabilities"},  # capabilities: only the server (checked below)
    "tools": set(),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(GPUD.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in GPUD.rglob("*.py")}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Every gpud module ``path`` imports, anywhere in it (functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gpud":
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names} & known  # from gpud.host import store
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "gpud"}
    return found & known


def graph() -> dict[str, set[str]]:
    known = set(modules())
    return {name: imports_of(path, known) - {name} for name, path in modules().items()}


def folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in FOLDERS else None


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_gpud_is_its_folders_and_the_entry_point() -> None:
    top = {p.name for p in GPUD.iterdir() if not p.name.startswith(("__pycache__", "."))}
    assert top == FOLDERS | {"__init__.py", "main.py"}, "a new top-level module: put it in the folder of its role"
    for name in FOLDERS:
        assert (GPUD / name / "__init__.py").read_text().startswith('"""'), f"gpud/{name} says what it holds"


def test_the_shell_has_no_import_cycle() -> None:
    edges = {name: {d for d in deps if folder(d) is not None or d == "gpud.main"} for name, deps in graph().items()}
    assert cycle(edges) is None, " -> ".join(cycle(edges) or [])


def test_the_layers_point_one_way() -> None:
    """Nothing below imports anything above, with no exception: the folders' graph has no cycle."""
    for i, layer in enumerate(LAYERS):
        assert MAY_IMPORT[layer] <= set(LAYERS[:i]), f"gpud/{layer} may import a layer above it"
    assert cycle(MAY_IMPORT) is None, " -> ".join(cycle(MAY_IMPORT) or [])
    edges: dict[str, set[str]] = {name: set() for name in FOLDERS}
    up = []
    for name, deps in graph().items():
        for dep in deps:
            own, other = folder(name), folder(dep)
            if own is None or other is None or own == other:
                continue
            edges[own].add(other)
            if own in LAYERS and other in LAYERS and LAYERS.index(other) > LAYERS.index(own):
                up.append(f"{name} imports {dep}: gpud/{other} is above gpud/{own}")
    assert not up, "\n".join(up)
    assert cycle(edges) is None, " -> ".join(cycle(edges) or [])


def test_each_folder_imports_only_what_its_role_allows() -> None:
    wrong = []
    for name, deps in graph().items():
        own = folder(name)
        if own is None:
            continue
        for dep in deps:
            other = folder(dep)
            if other is not None and other != own and other not in MAY_IMPORT[own]:
                wrong.append(f"{name} imports {dep}")
            elif other is None and dep != "gpud":
                wrong.append(f"{name} imports {dep}")
    assert not wrong, "\n".join(wrong)


def test_only_the_daemon_wires_the_capabilities() -> None:
    wrong = [
        f"{name} imports {dep}"
        for name, deps in graph().items()
        if folder(name) == "serving"
        for dep in deps
        if folder(dep) == "capabilities" and name != "gpud.serving.server"
    ]
    assert not wrong, "\n".join(wrong)


def capability(module: str) -> str | None:
    """The capability a module belongs to: ``gpud.capabilities.leases`` and every module of the
    package ``gpud.capabilities.allocations`` are one each."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "capabilities" else None


def test_no_capability_imports_another() -> None:
    wrong = [
        f"{name} imports {dep}"
        for name, deps in graph().items()
        if (own := capability(name)) is not None
        for dep in deps
        if capability(dep) not in (None, own)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_tools_are_clients_of_the_daemon() -> None:
    for name, deps in graph().items():
        if folder(name) == "tools":
            assert all(folder(d) == "tools" for d in deps), f"{name} imports {sorted(deps)}: a tool speaks gpud_client"


def test_the_checks_see_imports_of_every_form(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "import gpud.host.store\nfrom gpud.kit import links\nfrom gpud.core.errors import Refused\n"
        "def f():\n    from gpud.tools.spawn import DaemonProcess\n"
    )
    known = {"gpud.host.store", "gpud.kit.links", "gpud.kit", "gpud.core.errors", "gpud.tools.spawn"}
    assert imports_of(src, known) == known


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


# A module of the core or of a capability holds one rule family: at most about this many lines, with
# no exception (a capability that outgrows one module becomes a package of them, as allocations did).
MAX_LINES = 500


def test_no_core_or_capability_module_is_over_the_size_limit() -> None:
    lines = {
        str(p.relative_to(GPUD.parent)): len(p.read_text().splitlines())
        for name in ("core", "capabilities")
        for p in (GPUD / name).rglob("*.py")
    }
    over = sorted(path for path, n in lines.items() if n > MAX_LINES)
    assert not over, f"over {MAX_LINES} lines: {over}: split it by rule family"


def test_the_kubernetes_agent_is_a_client_of_the_daemon() -> None:
    """gpud-k8s (gpud_k8s/) speaks to gpud through gpud_client alone, as any client does, and the daemon
    imports nothing of it (gRPC and the Kubernetes client stay out of the daemon)."""
    agent = GPUD.parent / "gpud_k8s"
    wrong = [
        f"{path.relative_to(GPUD.parent)} imports {dep}"
        for path in agent.rglob("*.py")
        for dep in imports_of(path, set(modules()) | {"gpud"})
    ]
    assert not wrong, "\n".join(wrong)
    for name, path in modules().items():
        text = path.read_text()
        assert "gpud_k8s" not in text and "import grpc" not in text, f"{name}: the daemon imports the agent or gRPC"
