"""One owner of KV block lifetimes: only the scheduler (and the kv package itself) may import
the KV cache manager or its block pool, or reach the manager's members.

Everyone else gets facts (pdpool.engine.kv.facts) and connector hand-offs
(pdpool.engine.connector.base), so the question "who may free this block, and when" has one
answer: engine/scheduler.py. The scan reads the source, so a new caller fails here before it
ships, whether or not a test happens to drive it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from pdpool.engine.kv.manager import KVCacheManager

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("engine", "sidecar", "operator", "pdpool", "kernels")
OWNERS = {"engine/scheduler.py"}
OWNER_PACKAGE = "engine/kv/"
FORBIDDEN_MODULES = {"pdpool.engine.kv.manager", "pdpool.engine.kv.block_pool"}
# Reads of the scheduler's manager allowed outside it, each with why.
ALLOWED_SCHEDULER_KV = {
    # LLMEngine.kv: an inspection handle for tests and benchmarks; the engine never calls it.
    ("engine/engine_core.py", "kv"),
}


def manager_members() -> set[str]:
    """Every public name a KVCacheManager answers: methods, properties, attributes."""
    names = {n for n in dir(KVCacheManager) if not n.startswith("_")}
    names |= {n for n in vars(KVCacheManager(4, 16)) if not n.startswith("_")}
    return names


def _names_kv(node: ast.expr) -> bool:
    """`kv` or `<anything>.kv`: how the manager is reached when it is reached."""
    return (isinstance(node, ast.Name) and node.id == "kv") or (
        isinstance(node, ast.Attribute) and node.attr == "kv"
    )


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Scan(ast.NodeVisitor):
    def __init__(self, path: str, members: set[str]) -> None:
        self.path = path
        self.members = members
        self.functions: list[str] = []
        self.problems: list[str] = []

    def _flag(self, node: ast.AST, what: str) -> None:
        self.problems.append(f"{self.path}:{getattr(node, 'lineno', 0)}: {what}")

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node):  # annotations only: nothing is called through them
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name in FORBIDDEN_MODULES:
                self._flag(node, f"imports {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if module in FORBIDDEN_MODULES:
            self._flag(node, f"imports from {module}")
        if module == "pdpool.engine.kv":
            for alias in node.names:
                if f"{module}.{alias.name}" in FORBIDDEN_MODULES:
                    self._flag(node, f"imports {module}.{alias.name}")

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if _names_kv(node.value) and node.attr in self.members:
            self._flag(node, f"reaches the KV manager's `{node.attr}`")
        if node.attr == "kv" and isinstance(node.value, ast.Attribute):
            function = self.functions[-1] if self.functions else ""
            if node.value.attr == "scheduler" and (self.path, function) not in (
                ALLOWED_SCHEDULER_KV
            ):
                self._flag(node, "reads the scheduler's KV manager")
        self.generic_visit(node)


def scan_source(path: str, source: str, members: set[str]) -> list[str]:
    scan = _Scan(path, members)
    scan.visit(ast.parse(source))
    return scan.problems


def production_files() -> list[Path]:
    return sorted(p for folder in PRODUCTION for p in (ROOT / folder).rglob("*.py"))


def test_only_the_scheduler_reaches_the_kv_manager():
    members = manager_members()
    problems = []
    for path in production_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in OWNERS or rel.startswith(OWNER_PACKAGE):
            continue
        problems += scan_source(rel, path.read_text(), members)
    assert not problems, "only engine/scheduler.py may reach the KV manager:\n" + "\n".join(
        problems
    )


def test_the_scheduler_owns_the_manager():
    """Not vacuous: the owner imports the manager and the scan finds its calls."""
    source = (ROOT / "engine/scheduler.py").read_text()
    found = scan_source("engine/scheduler.py", source, manager_members())
    assert any("imports from pdpool.engine.kv.manager" in p for p in found)
    assert any("`allocate_slots`" in p for p in found) and any("`free`" in p for p in found)


def test_the_scan_catches_each_way_of_reaching_the_manager():
    members = manager_members()
    cases = {
        "from pdpool.engine.kv.manager import KVCacheManager": "imports from",
        "import pdpool.engine.kv.block_pool": "imports pdpool.engine.kv.block_pool",
        "from pdpool.engine.kv import manager": "imports pdpool.engine.kv.manager",
        "def f(engine):\n    return engine.kv.pool.num_free_blocks": "`pool`",
        "def f(self, r):\n    self.kv.free(r)": "`free`",
        "def f(kv):\n    return kv.block_tables('r')": "`block_tables`",
        "def f(self):\n    return self.scheduler.kv": "scheduler's KV manager",
    }
    for source, expected in cases.items():
        found = scan_source("engine/x.py", source, members)
        assert any(expected in p for p in found), (source, found)
    quiet = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pdpool.engine.kv.manager import KVCacheManager\n"
        "def f(self):\n    return self.scheduler.kv_usage().blocks_used\n"
    )
    assert scan_source("engine/x.py", quiet, members) == []
