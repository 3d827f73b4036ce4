"""Isolation with nothing tuned, end to end: `pdpool up --tenants-file` (one real decode
engine, its sidecar, the gateway) with two tenants of equal weight, no limits and no pool
section. A noisy tenant opens many long streams at once: the gateway lets the engine hold
only what its learned concurrency limit allows (from the engine's ITL) and keeps the rest
in the noisy tenant's queue, and the quiet tenant's requests go past that queue."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.support.e2e_helpers import cleanup, metric, start_topology

pytestmark = pytest.mark.slow

QUIET, NOISY = "quiet-tenant-key-0000001", "noisy-tenant-key-0000002"
TENANTS = f"""
tenants:
  - {{name: quiet, keys: ["{QUIET}"]}}
  - {{name: noisy, keys: ["{NOISY}"]}}
"""
STREAMS = 16  # of 300 tokens: KV stays below the saturation detector's 0.8 even with all


def body(max_tokens: int) -> dict:
    return {"prompt": "river stone cloud lantern", "max_tokens": max_tokens, "ignore_eos": True}


async def stream(c: httpx.AsyncClient, key: str, max_tokens: int) -> int:
    headers = {"authorization": f"Bearer {key}"}
    async with c.stream(
        "POST", "/v1/completions", json={**body(max_tokens), "stream": True}, headers=headers
    ) as r:
        async for _ in r.aiter_bytes():
            pass
        return r.status_code


@pytest.fixture(scope="module")
def topo(tmp_path_factory):
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    tenants.write_text(TENANTS)
    t = start_topology(
        tmp_path_factory, prefill=0, decode=1, mode="aggregated", tenants_file=str(tenants)
    )
    yield t
    cleanup(t)


async def test_many_streams_of_one_tenant_are_held_and_another_tenant_goes_past(topo):
    url = topo.gateway.url
    gauge = "pdpool_flow_queue_length"
    done = asyncio.Event()

    async def keep_open(c: httpx.AsyncClient) -> set[int]:
        statuses = set()
        while not done.is_set():
            statuses.add(await stream(c, NOISY, 300))
        return statuses

    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        flood = [asyncio.ensure_future(keep_open(c)) for _ in range(STREAMS)]
        try:
            deadline = time.monotonic() + 60
            while metric(url, gauge, 'tenant="noisy"') == 0:  # held by the gateway...
                assert time.monotonic() < deadline, "the gateway never held a noisy request"
                assert not all(f.done() for f in flood)
                await asyncio.sleep(0.1)
            limit = metric(url, "pdpool_flow_concurrency_limit")
            assert 1 <= limit < STREAMS  # ...because the engines' learned limit is below 16
            assert metric(url, "pdpool_flow_in_flight", 'tenant="noisy"') < STREAMS
            for _ in range(3):  # the quiet tenant goes past the noisy tenant's queue
                r = await c.post("/v1/completions", json=body(8), headers={"x-api-key": QUIET})
                assert r.status_code == 200 and r.json()["choices"][0]["text"]
            assert metric(url, gauge, 'tenant="noisy"') > 0  # still queued: served before them
            assert metric(url, "pdpool_flow_shed_total") == 0  # nothing refused
        finally:  # the flood ends (and its clients close) whatever was asserted
            done.set()
            await asyncio.wait(flood, timeout=120)
        assert set().union(*await asyncio.gather(*flood)) == {200}  # the flood served in turn
