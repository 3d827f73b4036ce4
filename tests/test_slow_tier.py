"""The fast tier (`pytest -m "not slow"`) starts no process: every test that reaches a
process-starting helper (an engine process, a `pdpool up` topology, a control plane, an
operator process, Prometheus, a subprocess.Popen or multiprocessing Process) carries the
`slow` marker, by decorator, by its module's or class's `pytestmark`, or by a conftest hook that
marks its folder (or the tests using the fixtures the hook names).

Static: the tests' source is read, never imported or run, so this answers in a second."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent
# Names whose use starts processes that outlive a call: devtools' and tests/support's
# starters, and the standard library's.
STARTERS = {
    "SpawnedEngine",  # devtools/engine_procs.py
    "spawned_engine",
    "CoreProcessClient",  # engine/core_process_client.py: spawns an engine core
    "start_topology",  # tests/support/e2e_helpers.py: a `pdpool up` topology
    "LocalCluster",  # devtools/devcluster.py: etcd, kube-apiserver, ...
    "OperatorProcess",  # devtools/operator_kube.py
    "Prometheus",  # devtools/prometheus_run.py
    "PeerProcess",  # tests/support/peer_process.py
    "engine_set",  # tests/support/pd_router.py
    "ServeHolder",  # tests/support/load_suite.py
    "UpHolder",  # (and a `Topology` whose .start() is called: pdpool/up/topology.py)
    "Popen",  # subprocess.Popen
    "Process",  # multiprocessing
}


def names_in(node: ast.AST) -> set[str]:
    """Every name a piece of code mentions (bare names and attribute names)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def is_slow_mark(node: ast.AST) -> bool:
    """`pytest.mark.slow`, alone or in a list or tuple (pytestmark = [...])."""
    return any(isinstance(n, ast.Attribute) and n.attr == "slow" for n in ast.walk(node))


def params(fn: ast.AST) -> list[str]:
    assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
    return [a.arg for a in fn.args.args + fn.args.kwonlyargs]


@dataclass
class Module:
    """A test module's (or conftest's) functions, their reach, and its slow markers."""

    path: Path
    functions: dict[str, ast.AST] = field(default_factory=dict)
    module_slow: bool = False
    slow_functions: set[str] = field(default_factory=set)
    tests: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> "Module":
        tree = ast.parse(path.read_text(), filename=str(path))
        m = cls(path)
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
            ):
                m.module_slow = m.module_slow or is_slow_mark(node.value)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                m._function(node, any(is_slow_mark(d) for d in node.decorator_list))
            elif isinstance(node, ast.ClassDef):
                class_slow = any(is_slow_mark(d) for d in node.decorator_list) or any(
                    isinstance(s, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in s.targets)
                    and is_slow_mark(s.value)
                    for s in node.body
                )
                for s in node.body:
                    if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        slow = class_slow or any(is_slow_mark(d) for d in s.decorator_list)
                        m._function(s, slow, owner=node.name)
        return m

    def _function(self, fn: ast.AST, slow: bool, owner: Optional[str] = None) -> None:
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        name = f"{owner}.{fn.name}" if owner else fn.name
        self.functions.setdefault(fn.name, fn)  # fixtures and helpers, by their bare name
        self.functions[name] = fn
        if slow:
            self.slow_functions.add(name)
        if fn.name.startswith("test"):
            self.tests.append(name)


def starts_processes(
    name: str, local: dict[str, ast.AST], shared: dict[str, ast.AST], seen: set[str]
) -> bool:
    """Whether function `name` (a test, a fixture, a helper) reaches a starter: directly, or
    through a function or fixture of its module or of a conftest above it."""
    fn = local.get(name) or shared.get(name.split(".")[-1])
    if fn is None or name in seen:
        return False
    seen.add(name)
    mentioned = names_in(fn) | set(params(fn))
    if mentioned & STARTERS or {"Topology", "start"} <= mentioned:  # a topology started
        return True
    return any(starts_processes(n, local, shared, seen) for n in mentioned if n != name)


@dataclass
class ConftestRule:
    """What a conftest's pytest_collection_modifyitems marks slow: its whole folder, or the
    tests that use one of `fixtures`."""

    folder: Path
    fixtures: Optional[set[str]]  # None: every test below the folder


def conftest_rules(path: Path) -> list[ConftestRule]:
    tree = ast.parse(path.read_text(), filename=str(path))
    constants = {
        t.id: {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    rules = []
    for node in tree.body:
        if not (isinstance(node, ast.FunctionDef) and node.name == "pytest_collection_modifyitems"):
            continue
        if not is_slow_mark(node):
            continue
        used = names_in(node)
        if "fixturenames" not in used:
            rules.append(ConftestRule(path.parent, None))
            continue
        fixtures = {
            c.value
            for c in ast.walk(node)
            if isinstance(c, ast.Constant) and isinstance(c.value, str)
        }
        for name in used & set(constants):
            fixtures |= {v for v in constants[name] if isinstance(v, str)}
        rules.append(ConftestRule(path.parent, fixtures))
    return rules


def fixture_closure(name: str, local: dict[str, ast.AST], shared: dict[str, ast.AST]) -> set[str]:
    """The fixture names a test requests, directly or through its fixtures' parameters."""
    out: set[str] = set()
    todo = list(params(local.get(name) or shared[name]))
    while todo:
        p = todo.pop()
        if p in out:
            continue
        out.add(p)
        fn = local.get(p) or shared.get(p)
        if fn is not None:
            todo.extend(params(fn))
    return out


def unmarked_process_tests(root: Path = ROOT) -> list[str]:
    conftests = sorted(root.rglob("conftest.py"))
    problems = []
    for path in sorted(root.rglob("test_*.py")):
        above = [c for c in conftests if c.parent in path.parents]
        shared: dict[str, ast.AST] = {}
        rules: list[ConftestRule] = []
        for c in above:  # nearer conftests last: their fixtures override
            shared.update(Module.read(c).functions)
            rules += conftest_rules(c)
        m = Module.read(path)
        if m.module_slow:
            continue
        for test in m.tests:
            if test in m.slow_functions:
                continue
            if not starts_processes(test, m.functions, shared, set()):
                continue
            fixtures = fixture_closure(test, m.functions, shared)
            if any(r.fixtures is None or r.fixtures & fixtures for r in rules):
                continue
            problems.append(f"{path.relative_to(root.parent)}::{test}")
    return problems


def test_every_process_starting_test_is_slow():
    problems = unmarked_process_tests()
    assert not problems, (
        "these tests start processes but are not marked slow (decorate them with "
        "`@pytest.mark.slow`, or set `pytestmark = pytest.mark.slow` in their module):\n"
        + "\n".join(problems)
    )


def test_the_check_finds_an_unmarked_starter_and_accepts_each_marking(tmp_path):
    tests = tmp_path / "tests"
    (tests / "sub").mkdir(parents=True)
    (tests / "conftest.py").write_text(
        "import pytest\n"
        "@pytest.fixture\n"
        "def engine(tmp_path):\n"
        "    with spawned_engine(tmp_path, tmp_path) as e:\n"
        "        yield e\n"
    )
    (tests / "test_bare.py").write_text(
        "import subprocess\n"
        "def helper():\n    return subprocess.Popen(['true'])\n"
        "def test_calls_helper():\n    helper().wait()\n"
        "def test_uses_fixture(engine):\n    assert engine\n"
        "def test_pure():\n    assert 1\n"
    )
    (tests / "test_module_marked.py").write_text(
        "import pytest\npytestmark = [pytest.mark.slow]\n"
        "def test_uses_fixture(engine):\n    assert engine\n"
    )
    (tests / "test_decorated.py").write_text(
        "import pytest\n"
        "@pytest.mark.slow\ndef test_uses_fixture(engine):\n    assert engine\n"
        "class TestGroup:\n    pytestmark = pytest.mark.slow\n"
        "    def test_in_class(self, engine):\n        assert engine\n"
    )
    (tests / "sub" / "conftest.py").write_text(
        "import pytest\n"
        "STARTING = {'engine'}\n"
        "def pytest_collection_modifyitems(config, items):\n"
        "    for item in items:\n"
        "        if STARTING & set(item.fixturenames):\n"
        "            item.add_marker(pytest.mark.slow)\n"
    )
    (tests / "sub" / "test_by_hook.py").write_text(
        "def test_uses_fixture(engine):\n    assert engine\n"
    )
    assert unmarked_process_tests(tests) == [
        "tests/test_bare.py::test_calls_helper",
        "tests/test_bare.py::test_uses_fixture",
    ]
