"""The packages under sidecar/ are split by concern and depend on each other one way:

    net (shared networking)  <-  flow (flow control), kv (the KV index)
                             <-  routing (the router's core: endpoint pool, plugins, P/D)
                             <-  gateway, epp, proxy (the programs)

Checked on the source (every import, also those inside functions or TYPE_CHECKING), so a
cycle between packages fails here before it fails anyone at import time."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ROOT / "sidecar"
BASE = "pdpool.sidecar"

# What each package may import of its siblings.
ALLOWED = {
    "net": set(),
    "flow": {"net"},
    "kv": {"net"},
    "routing": {"net", "flow", "kv"},
    "gateway": {"net", "flow", "kv", "routing"},
    "epp": {"net", "flow", "kv", "routing"},
    "proxy": {"net", "flow", "kv", "routing"},
}


def imported(path: Path, package: str) -> set[str]:
    """Absolute names a module imports (relative imports resolved against `package`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names.add(prefix)
            names.update(f"{prefix}.{alias.name}" for alias in node.names)
    return names


def package_graph() -> dict[str, set[str]]:
    """Sibling package -> the sibling packages its modules import."""
    graph: dict[str, set[str]] = {}
    for folder in sorted(p for p in TOP.iterdir() if (p / "__init__.py").is_file()):
        edges = graph.setdefault(folder.name, set())
        for path in folder.rglob("*.py"):
            rel = path.relative_to(TOP).with_suffix("")
            package = ".".join([BASE, *rel.parts[:-1]])
            for name in imported(path, package):
                parts = name.split(".")
                sibling = parts[2] if parts[:2] == ["pdpool", "sidecar"] and len(parts) > 2 else ""
                if sibling and sibling != folder.name and (TOP / sibling).is_dir():
                    edges.add(sibling)
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph (the packages on it), or [] when it has none."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_cycle_finder_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_cycle_between_packages():
    graph = package_graph()
    assert not cycle(graph), " -> ".join(cycle(graph))


def test_every_package_has_a_declared_place():
    assert set(package_graph()) == set(ALLOWED)


def test_packages_import_only_the_layers_below():
    wrong = {
        name: sorted(edges - ALLOWED.get(name, set()))
        for name, edges in package_graph().items()
        if edges - ALLOWED.get(name, set())
    }
    assert not wrong, f"imports across layers: {wrong}"
