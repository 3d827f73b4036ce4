"""The routing core on its own: no HTTP, probes and outcomes handed in as a front-end would."""

from __future__ import annotations

import asyncio

import pytest

from pdpool.sidecar.net.metrics import GatewayMetrics
from pdpool.sidecar.routing.core import Routing
from pdpool.sidecar.routing.settings import RoutingSettings

BACKENDS = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]


def make(**overrides):
    settings = RoutingSettings(decode_urls=list(BACKENDS), health_interval_s=3600, **overrides)
    return Routing(settings, GatewayMetrics())


async def started(routing: Routing, sick: frozenset[str] = frozenset()) -> Routing:
    async def probe(backend: str) -> bool:
        return backend not in sick

    await routing.start(probe)
    return routing


def chat(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def test_the_same_prefix_goes_to_the_same_backend_and_others_spread():
    async def run():
        routing = await started(make())
        try:
            first = await routing.route(chat("a conversation about tea " * 20), {})
            again = await routing.route(chat("a conversation about tea " * 20), {})
            assert first.order == again.order and first.preferred
            assert sorted(first.order) == sorted(BACKENDS)
            owners = {
                (await routing.route(chat(f"topic {i} " * 40), {})).order[0] for i in range(30)
            }
            assert len(owners) == 3  # the ring spreads different prefixes
        finally:
            await routing.stop()

    asyncio.run(run())


def test_load_spills_to_the_next_backend_and_returns_when_it_drains():
    async def run():
        routing = await started(make(balance=1.0))
        try:
            body = chat("hot prefix " * 30)
            owner = (await routing.route(body, {})).order[0]
            with routing.tracked(owner), routing.tracked(owner):
                spilled = await routing.route(body, {})
                assert spilled.order[0] != owner and not spilled.preferred
                assert routing.load(owner) == 2
            assert routing.load(owner) == 0
            assert (await routing.route(body, {})).order[0] == owner
        finally:
            await routing.stop()

    asyncio.run(run())


def test_a_failed_probe_ejects_and_a_sick_backend_is_tried_last():
    async def run():
        sick = BACKENDS[1]
        routing = await started(make(), frozenset({sick}))
        try:
            assert not routing.healthy(sick) and sick not in routing.healthy_backends()
            for i in range(20):
                route = await routing.route(chat(f"prompt {i} " * 30), {})
                assert route.order[-1] == sick
        finally:
            await routing.stop()

    asyncio.run(run())


@pytest.mark.parametrize("reason, failures_to_eject", [("connect_error", 1), ("server_error", 3)])
def test_failures_eject(reason, failures_to_eject):
    async def run():
        routing = await started(make(outlier_failures=3, ejection_s=60))
        try:
            backend = BACKENDS[0]
            for _ in range(failures_to_eject - 1):
                routing.failed(backend, reason)
                assert routing.healthy(backend)
            routing.failed(backend, reason)
            assert not routing.healthy(backend)
            assert routing.others_healthy(backend)
            # Ejected for 60 s: a good probe does not readmit it yet.
            routing.mark(backend, True)
            assert not routing.healthy(backend)
            assert routing.next_backend(BACKENDS, []) != backend
        finally:
            await routing.stop()

    asyncio.run(run())


def test_a_success_resets_the_failure_count():
    async def run():
        routing = await started(make(outlier_failures=2))
        try:
            backend = BACKENDS[0]
            routing.failed(backend, "server_error")
            routing.served(backend)
            routing.failed(backend, "server_error")
            assert routing.healthy(backend)
        finally:
            await routing.stop()

    asyncio.run(run())


def test_settings_are_checked():
    with pytest.raises(ValueError, match="decode-url"):
        Routing(RoutingSettings(), GatewayMetrics())
    with pytest.raises(ValueError, match="balance"):
        make(balance=0.5)
