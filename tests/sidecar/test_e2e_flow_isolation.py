"""Fair shares through real processes: `pdpool up --tenants-file` (one real decode engine,
its sidecar, the gateway) with two tenants of equal weight and no limits, the pool's bound
given (`maxInFlightPerBackend: 8`) so that its size does not depend on this machine's
speed (the learned bound is tested without HTTP in test_concurrency_limit.py).

- a tenant alone holds the whole pool (8 streams), the rest of its burst waits in its queue;
- a second tenant that then opens as many streams gets its half at once, the first one
  cannot take it back as its streams end, and the tokens streamed to the two in a window
  after that are about equal."""

from __future__ import annotations

import asyncio
import statistics
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
pool: {{maxInFlightPerBackend: 8}}
"""
BOUND, STREAMS, TOKENS = 8, 16, 300


def body(max_tokens: int) -> dict:
    return {"prompt": "river stone cloud lantern", "max_tokens": max_tokens, "ignore_eos": True}


class Streams:
    """Tenants' closed-loop streams, counting the tokens (SSE events) each receives while
    `counting` is set."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client, self.done = client, asyncio.Event()
        self.counting = False
        self.tokens = {QUIET: 0, NOISY: 0}
        self.statuses: set[int] = set()

    async def one(self, key: str) -> None:
        headers = {"authorization": f"Bearer {key}"}
        payload = {**body(TOKENS), "stream": True}
        async with self.client.stream(
            "POST", "/v1/completions", json=payload, headers=headers
        ) as r:
            self.statuses.add(r.status_code)
            async for line in r.aiter_lines():
                if self.counting and line.startswith("data: {"):
                    self.tokens[key] += 1

    async def keep_open(self, key: str) -> None:
        while not self.done.is_set():
            await self.one(key)

    def open(self, key: str, n: int) -> list[asyncio.Future]:
        return [asyncio.ensure_future(self.keep_open(key)) for _ in range(n)]


@pytest.fixture(scope="module")
def topo(tmp_path_factory):
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    tenants.write_text(TENANTS)
    t = start_topology(
        tmp_path_factory, prefill=0, decode=1, mode="aggregated", tenants_file=str(tenants)
    )
    yield t
    cleanup(t)


async def wait_for(check, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


async def test_alone_a_tenant_holds_the_pool_and_cannot_keep_another_ones_share(topo):
    url = topo.gateway.url

    def in_flight(tenant: str) -> float:
        return metric(url, "pdpool_flow_in_flight", f'tenant="{tenant}"')

    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        s = Streams(c)
        flood = s.open(NOISY, STREAMS)
        quiet: list[asyncio.Future] = []
        try:
            # alone: the whole pool, the rest of its burst queued
            await wait_for(lambda: in_flight("noisy") == BOUND, "noisy never held the pool")
            assert metric(url, "pdpool_flow_queue_length", 'tenant="noisy"') > 0
            quiet = s.open(QUIET, STREAMS)
            # the newcomer's half comes at once (past the bound), not as noisy streams end
            await wait_for(lambda: in_flight("quiet") >= BOUND / 2, "quiet never got its half", 10)
            # as the noisy streams end, the noisy tenant drops to its half and stays there
            await wait_for(lambda: in_flight("noisy") <= BOUND / 2, "noisy kept the pool")
            samples = []
            s.counting = True
            for _ in range(40):
                samples.append((in_flight("quiet"), in_flight("noisy")))
                await asyncio.sleep(0.1)
            s.counting = False
            assert sum(q >= BOUND / 2 - 1 for q, _ in samples) >= 0.9 * len(samples), samples
            # The places go to the tenant served less (each admission is charged its
            # expected streaming time at once), so the two swing around their halves as
            # streams end, the more on a loaded machine; the first never takes the pool back.
            noisy = [n for _, n in samples]
            assert max(noisy) <= BOUND * 3 / 4 and statistics.fmean(noisy) <= BOUND / 2 + 1, samples
            ratio = s.tokens[QUIET] / max(1, s.tokens[NOISY])
            assert 0.7 <= ratio <= 1.4, s.tokens  # equal weights: about equal tokens
            assert metric(url, "pdpool_flow_shed_total") == 0  # nothing refused
        finally:  # the streams end (and their clients close) whatever was asserted
            s.done.set()
            await asyncio.wait(flood + quiet, timeout=120)
        assert s.statuses == {200}
