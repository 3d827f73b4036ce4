"""Lint and type checks, run by the suite so that CI and a new user see them alike."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The packages mypy checks: strict ones are marked in pyproject.toml.
TYPED = [
    ("-m", "pdpool"),
    ("-m", "pdpool.units"),
    ("-p", "pdpool.engine.kv"),
    ("-m", "pdpool.engine.scheduler"),
    ("-p", "pdpool.engine.connector"),
    ("-p", "pdpool.sidecar"),
    ("-p", "pdpool.operator"),
    ("-p", "pdpool.planner"),
    ("-m", "pdpool.engine.engine_core"),
    ("-m", "pdpool.engine.core_loop"),
    ("-m", "pdpool.engine.core_process"),
    ("-m", "pdpool.engine.core_client"),
    ("-m", "pdpool.engine.core_process_client"),
    ("-m", "pdpool.engine.output_processor"),
    ("-m", "pdpool.engine.stop_check"),
    ("-m", "pdpool.engine.runner"),
    ("-p", "pdpool.engine.server"),
    ("-m", "pdpool.engine.core_channel"),
    ("-m", "pdpool.engine.core_messages"),
    ("-m", "pdpool.engine.outputs"),
    ("-m", "pdpool.engine.engine_state"),
    ("-m", "pdpool.engine.model_info"),
]
PACKAGE_FOLDERS = {
    "engine": "engine",
    "sidecar": "sidecar",
    "operator": "operator",
    "kernels": "kernels",
    "planner": "pdpool/planner",  # a subpackage: the pdpool/*.py links do not bring it
}


def run_ruff(*args: str) -> subprocess.CompletedProcess:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed (it is in the dev extra: pip install -e '.[dev]')")
    return subprocess.run(
        [ruff, *args, "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_ruff_lint_is_clean():
    done = run_ruff("check")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_ruff_format_is_applied():
    # The dev extra pins ruff's version: its formatter's style changes between releases.
    done = run_ruff("format", "--check")
    assert done.returncode == 0, (
        "run `ruff format .`:\n" + done.stdout[-4000:] + done.stderr[-2000:]
    )


def test_mypy_is_clean(tmp_path):
    pytest.importorskip("mypy", reason="mypy is in the dev extra")
    # mypy resolves modules from files: lay the folders out as the pdpool package they
    # become when installed.
    tree = tmp_path / "pdpool"
    tree.mkdir()
    for module in (ROOT / "pdpool").glob("*.py"):
        (tree / module.name).symlink_to(module)
    for name, folder in PACKAGE_FOLDERS.items():
        (tree / name).symlink_to(ROOT / folder)
    args = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "--cache-dir",
        str(tmp_path / ".mypy_cache"),
    ]
    for flag, name in TYPED:
        args += [flag, name]
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
