"""The repository's shape: nothing at its root shadows the standard library, and the import
contracts between the parts hold (checked on the source, without importing it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def importable_names_at_root() -> list[str]:
    """What `import NAME` finds at the repository root: packages (folders with an
    __init__.py) and modules (.py files)."""
    names = []
    for entry in ROOT.iterdir():
        if entry.is_dir() and (entry / "__init__.py").is_file():
            names.append(entry.name)
        elif entry.suffix == ".py":
            names.append(entry.stem)
    return names


def test_nothing_at_the_root_shadows_a_standard_library_module():
    shadowing = sorted(set(importable_names_at_root()) & set(sys.stdlib_module_names))
    assert not shadowing, f"importable from the repository root and in the stdlib: {shadowing}"


def test_stdlib_operator_works_from_the_repository_root():
    done = subprocess.run(
        [sys.executable, "-c", "import operator; operator.eq(1, 1)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


# The parts that ship in slim images (no torch) and what they may never import.
CONTRACTS = {
    "sidecar": ("pdpool.engine", "pdpool.kernels", "torch", "transformers", "triton"),
    "operator": ("pdpool.engine", "pdpool.kernels", "pdpool.sidecar", "torch", "transformers"),
    "pdpool": ("pdpool.engine", "pdpool.kernels", "torch", "transformers", "triton"),
    # The KV manager is the one owner of blocks: its modules never reach for the model side.
    "engine/kv": ("pdpool.engine.runner", "pdpool.engine.models", "pdpool.kernels", "torch"),
    # Never installed: the benchmarks share devtools/ with the tests, never the tests themselves.
    "benchmarks": ("tests",),
    "devtools": ("tests", "benchmarks"),
}
# The folders setup.py installs as pdpool.*, and the development ones they may never import.
SHIPPED = ("pdpool", "engine", "kernels", "sidecar", "operator")
DEVELOPMENT_ONLY = ("devtools", "tests", "benchmarks")


def imported_modules(path: Path, package: str) -> set[str]:
    """Absolute names of everything a module imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names.add(prefix)
            names.update(f"{prefix}.{alias.name}" for alias in node.names)
    return names


def contract_violations(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    """`PATH imports NAME` for each module under `folder` that imports a forbidden name."""
    if folder in DEVELOPMENT_ONLY:
        base = folder
    else:
        base = "pdpool" if folder == "pdpool" else "pdpool." + folder.replace("/", ".")
    violations = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT / folder).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        package = ".".join([base, *parts[:-1]]) if parts else base
        for name in imported_modules(path, package):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                violations.append(f"{path.relative_to(ROOT)} imports {name}")
    return violations


@pytest.mark.parametrize("folder", sorted(CONTRACTS))
def test_import_contracts(folder):
    violations = contract_violations(folder, CONTRACTS[folder])
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("folder", SHIPPED)
def test_shipped_code_never_imports_development_folders(folder):
    violations = contract_violations(folder, DEVELOPMENT_ONLY)
    assert not violations, "\n".join(violations)
