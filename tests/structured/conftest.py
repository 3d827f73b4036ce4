"""A real `pdpool serve` of the tiny model per test module, and an OpenAI client of it."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from devtools.engine_procs import spawned_engine


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:  # a test on the engine process belongs to the full run's tier
        if here in Path(str(item.fspath)).parents and "server" in item.fixturenames:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    with spawned_engine(
        tiny_qwen3, tmp_path_factory.mktemp("logs"), "--num-kv-blocks", "512"
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id
