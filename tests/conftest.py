"""Fixtures shared by every test folder: tiny checkpoints and engine processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

try:  # Tiny CPU models: one thread avoids oversubscribing 2 cores shared with engine processes.
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass

# LoRA adapters for the tiny checkpoints (tests/lora, tests/vllm).
from tests.support.lora_fixtures import qwen3_5_adapters, qwen3_adapters  # noqa: F401


def _tiny(tmp_path_factory, name: str, **spec):
    pytest.importorskip("torch", reason="the engine extra (torch) is not installed")
    from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model

    cache = Path(os.environ.get("PDPOOL_TEST_MODELS", str(tmp_path_factory.getbasetemp())))
    out = cache / name
    if not (out / "model.safetensors").is_file():
        write_tiny_model(out, TinyModelSpec(**spec))
    return out


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    """2 layers, hidden 64, 4 heads / 2 KV heads, vocab 512, float32."""
    return _tiny(tmp_path_factory, "tiny-qwen3", arch="qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_sliding(tmp_path_factory) -> Path:
    """Like tiny_qwen3 with 4 layers, every other one a 32-token sliding window."""
    return _tiny(
        tmp_path_factory,
        "tiny-qwen3-sliding",
        arch="qwen3",
        seed=1,
        num_layers=4,
        sliding_window=32,
    )


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory) -> Path:
    """Hybrid Qwen3.5: Gated DeltaNet and gated full-attention layers."""
    return _tiny(tmp_path_factory, "tiny-qwen3_5", arch="qwen3_5", seed=2, num_layers=4)


# Tests that wait on the longest cold builds, in the order they run at the end of the suite.
# On a fresh machine .ci/run starts the builds beside the tests (.ci/builds): the tests before
# these give the builds their time instead of waiting for them.
LATE_BUILDS = ("k8s/build-binaries.sh", "images/build.sh")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "waits_for_build(script): needs what scripts/<script> builds; runs after the tests "
        "that need no long build",
    )


def run_rank(item) -> int:
    """0 for a test that needs no long build, else 1 + the place of its build in LATE_BUILDS
    (the latest of them when it is marked with several)."""
    scripts = [m.args[0] for m in item.iter_markers("waits_for_build")]
    return max((1 + LATE_BUILDS.index(s) for s in scripts), default=0)


@pytest.hookimpl(trylast=True)  # after the folders' hooks have marked their tests
def pytest_collection_modifyitems(config, items):
    # A file moves as a whole (its module fixtures are set up once), at its latest test's rank.
    file_rank: dict[str, int] = {}
    for item in items:
        file_rank[item.path] = max(file_rank.get(item.path, 0), run_rank(item))
    items.sort(key=lambda item: file_rank[item.path])  # stable


# Skips that only hardware can cause. Any other skip means a prerequisite the project's
# scripts build (a binary, a venv, an extra) is missing, and a green run would hide that the
# test never ran: it is reported as a failure with the skip's reason instead.
HARDWARE_SKIP_WORDS = ("CUDA",)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def skip_is_allowed(item, reason: str) -> bool:
    if os.environ.get("PDPOOL_ALLOW_SKIPS") == "1":  # a developer's opt-out, never CI's
        return True
    if item.get_closest_marker("gpu") is not None:
        return True
    return any(word in reason for word in HARDWARE_SKIP_WORDS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if not skip_is_allowed(item, reason):
        report.outcome = "failed"
        report.longrepr = (
            f"skipped for a reason that is not missing hardware, so it counts as a failure "
            f"(set PDPOOL_ALLOW_SKIPS=1 to allow it locally): {reason}"
        )
