"""Fixtures of the load suite: the tiny model at its full length (max_model_len 4096), one
`pdpool serve` with default flags (started again when a test left it broken, so that every
test reports its own failure) and one `pdpool up --prefill 1 --decode 2`."""

from __future__ import annotations

import pytest

from devtools.load_targets import ServeTarget, UpTarget
from tests.support.e2e_helpers import engine_available
from tests.support.load_suite import ServeHolder, UpHolder


@pytest.fixture(scope="session")
def model_dir() -> str:
    if not engine_available():
        pytest.skip("pdpool engine (torch) is not installed")
    from pdpool.up.topology import ensure_tiny_model

    return ensure_tiny_model("qwen3")


@pytest.fixture(scope="module")
def serve_holder(model_dir, tmp_path_factory):
    holder = ServeHolder(model_dir, tmp_path_factory.mktemp("serve"))
    yield holder
    holder.stop()


@pytest.fixture
def serve(serve_holder) -> ServeTarget:
    """`pdpool serve MODEL` with default flags, healthy when the test starts."""
    return serve_holder.get()


@pytest.fixture(scope="module")
def up_holder(model_dir, tmp_path_factory):
    holder = UpHolder(model_dir, tmp_path_factory.mktemp("up"))
    yield holder
    holder.stop()


@pytest.fixture
def up(up_holder) -> UpTarget:
    """`pdpool up --prefill 1 --decode 2`, every engine and the gateway healthy when the
    test starts."""
    return up_holder.get()
