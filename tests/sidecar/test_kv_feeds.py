"""KV event subscriptions that follow discovery (sidecar/kv/feeds.py): the engines an
EndpointSet lists are subscribed on the pool's event ports, vanished ones are dropped and
forgotten; a real `pdpool gateway --decode-service --kv-events-port` routes by the events
of a real publisher (pdpool.kv_events.KVEventPublisher, the engines' own)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time

import httpx
import pytest

from pdpool.block_hash import chain_hashes
from pdpool.kv_events import BlockStored, KVEventPublisher, KVEventsConfig
from pdpool.ports import free_port
from pdpool.sidecar.gateway.app import GatewaySettings
from pdpool.sidecar.kv.feeds import KVFeeds, check_event_ports, wanted_subscriptions
from pdpool.sidecar.kv.index import request_block_keys
from pdpool.sidecar.routing.kv_cost import KVRouter
from pdpool.sidecar.routing.prefill_ranking import PrefillRanking
from pdpool.sidecar.routing.picker import LoadPicker
from pdpool.sidecar.proxy.settings import SidecarSettings
from pdpool.up.topology import pdpool_command
from tests.support.e2e_helpers import metric

BS = 4
PROMPT = list(range(100, 132))  # 8 blocks of 4


def publisher(replay: bool = True) -> tuple[KVEventPublisher, int, int]:
    port, replay_port = free_port(), free_port()
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay_port}" if replay else None,
    )
    return KVEventPublisher(cfg), port, replay_port


def store(pub: KVEventPublisher, tokens: list[int]) -> None:
    """What an engine publishes when it caches `tokens` (whole blocks, no parent)."""
    pub.record(BlockStored(list(chain_hashes(tokens, BS)), None, list(tokens), BS))
    pub.flush()


def wait_for(check, timeout: float = 10.0, tick=None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        if tick is not None:
            tick()
        time.sleep(0.05)


def feed_threads(backend: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"kv-events-{backend}"]


# --- pure parts -----------------------------------------------------------------------------


def test_wanted_subscriptions_name_the_engine_in_each_endpoints_pod():
    got = wanted_subscriptions(["10.0.0.7:8000", "[fd00::5]:8080"], 5557, 5558)
    assert got == {
        "10.0.0.7:8000": "tcp://10.0.0.7:5557|tcp://10.0.0.7:5558",
        "[fd00::5]:8080": "tcp://[fd00::5]:5557|tcp://[fd00::5]:5558",
    }
    assert wanted_subscriptions(["10.0.0.7:8000"], 6000) == {"10.0.0.7:8000": "tcp://10.0.0.7:6000"}
    assert wanted_subscriptions([], 5557, 5558) == {}


@pytest.mark.parametrize(
    "port, replay, fragment",
    [
        (None, 5558, "--r needs --p"),
        (0, None, "--p must be in 1..65535"),
        (5557, 70000, "--r must be in 1..65535"),
        (5557, 5557, "--p and --r must differ"),
    ],
)
def test_bad_event_ports_are_refused(port, replay, fragment):
    with pytest.raises(ValueError, match=fragment):
        check_event_ports(port, replay, ("--p", "--r"))


def test_event_ports_in_gateway_and_sidecar_settings():
    assert check_event_ports(None, None, ("a", "b")) == (None, None)
    gw = GatewaySettings(decode_service="decode:8080", kv_events_port="5557").validate()
    assert (gw.kv_events_port, gw.kv_events_replay_port) == (5557, None)
    with pytest.raises(ValueError, match="--kv-events-replay-port needs --kv-events-port"):
        GatewaySettings(decode_service="decode:8080", kv_events_replay_port=5558).validate()
    with pytest.raises(ValueError, match="prefill_kv_events_port must be in"):
        SidecarSettings(prefill_kv_events_port=99999).validate()


# --- subscriptions on a real publisher ------------------------------------------------------


def test_feeds_subscribe_new_engines_and_forget_vanished_ones():
    pub, port, replay_port = publisher()
    router = KVRouter(BS)
    feeds = KVFeeds(router, port, replay_port)
    backend = "127.0.0.1:8000"
    keys = request_block_keys(PROMPT, BS)
    try:
        feeds.sync([backend])
        assert feeds.subscribed == {
            backend: f"tcp://127.0.0.1:{port}|tcp://127.0.0.1:{replay_port}"
        }
        wait_for(
            lambda: router.index.prefix_hit_blocks(backend, keys) == 8,
            tick=lambda: store(pub, PROMPT),
        )
        feeds.sync([])  # the pod left the Service
        assert feeds.subscribed == {} and not router.index.knows(backend)
        assert not feed_threads(backend)
        store(pub, PROMPT)
        time.sleep(0.3)
        assert router.index.prefix_hit_blocks(backend, keys) is None  # nobody listens
        # Back again: joining late, the engine's replay buffer rebuilds what it holds.
        feeds.sync([backend])
        wait_for(
            lambda: router.index.prefix_hit_blocks(backend, keys) == 8,
            tick=lambda: store(pub, PROMPT[:4]),
        )
    finally:
        router.close()
        pub.close()
    assert not feed_threads(backend)


def test_engines_silent_so_far_are_known_empty_and_a_cold_burst_spreads():
    """A pool that just started has published nothing: its engines count as empty from the
    subscription on (not unknown, which would keep the hash order), so a burst of new
    prompts spreads by the prefill work each leaves pending, and a repeat follows its
    prompt."""
    pubs = [publisher() for _ in range(2)]
    router = KVRouter(BS, expect_s=60.0)
    try:
        for name, (_, port, replay_port) in zip("ab", pubs, strict=True):
            router.subscribe(name, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
        assert router.index.knows("a") and router.index.knows("b")
        prompts = [[p * 100 + i for i in range(64)] for p in range(4)]
        idle = lambda b: 0  # noqa: E731
        chosen = [router.decide(["a", "b"], p, idle).order[0] for p in prompts]
        assert sorted(chosen) == ["a", "a", "b", "b"], chosen
        assert router.decide(["a", "b"], prompts[3] + [7] * 8, idle).order[0] == chosen[3]
    finally:
        router.close()
        for pub, _, _ in pubs:
            pub.close()


def test_feeds_leave_static_subscriptions_alone_and_ignore_no_change():
    router = KVRouter(BS)
    router.subscribe("10.0.0.1:8000", "tcp://127.0.0.1:1")
    feeds = KVFeeds(router, 5557, static=["10.0.0.1:8000"])
    try:
        feeds.sync(["10.0.0.1:8000", "127.0.0.1:8001"])
        assert feeds.subscribed == {"127.0.0.1:8001": "tcp://127.0.0.1:5557"}
        feeds.sync([])
        assert feed_threads("10.0.0.1:8000") and not feed_threads("127.0.0.1:8001")
        # refresh() does nothing (no thread hop) while the set is unchanged.
        calls = []
        feeds.sync = calls.append
        asyncio.run(feeds.refresh([]))
        assert calls == []
        asyncio.run(feeds.refresh(["127.0.0.1:8002"]))
        assert calls == [["127.0.0.1:8002"]]
    finally:
        router.close()


def test_a_subscription_that_fails_is_retried_on_the_next_sync():
    class Flaky(KVRouter):
        fail = True

        def subscribe(self, backend, endpoint, replay_endpoint=None):
            if self.fail:
                raise OSError("no route")
            super().subscribe(backend, endpoint, replay_endpoint)

    router = Flaky(BS)
    feeds = KVFeeds(router, 5557, retry_s=0.3)
    endpoints = ["127.0.0.1:8000"]
    try:
        asyncio.run(feeds.refresh(endpoints))  # logged, not raised
        assert feeds.subscribed == {}
        router.fail = False
        asyncio.run(feeds.refresh(endpoints))  # not at once (requests would each retry)
        assert feeds.subscribed == {}
        time.sleep(0.3)
        asyncio.run(feeds.refresh(endpoints))
        assert list(feeds.subscribed) == endpoints
    finally:
        router.close()


async def test_prefill_ranking_follows_the_prefill_set_with_only_the_port():
    pub, port, replay_port = publisher()
    ranking = PrefillRanking(LoadPicker(), {}, BS, events_port=port, events_replay_port=replay_port)
    warm, cold = "127.0.0.1:8000", "127.0.0.2:8000"
    try:
        assert ranking.router is not None
        await ranking.sync([warm, cold])
        assert set(ranking.feeds.subscribed) == {warm, cold}
        keys = request_block_keys(PROMPT, BS)
        for _ in range(200):
            if ranking.router.index.prefix_hit_blocks(warm, keys) == 8:
                break
            store(pub, PROMPT)
            await asyncio.sleep(0.05)
        order, by = await ranking.order([cold, warm], None, {"prompt": PROMPT})
        assert (order[0], by) == (warm, "kv")
        await ranking.sync([cold])
        assert not ranking.router.index.knows(warm)
    finally:
        ranking.close()
        pub.close()


def test_sidecar_flags_reach_the_settings():
    from pdpool.cli import build_parser
    from pdpool.sidecar.proxy.cli import settings_from_args

    args = build_parser().parse_args(
        [
            "sidecar",
            "--prefill-service",
            "prefill.ns.svc:8000",
            "--prefill-kv-events-port",
            "5557",
            "--prefill-kv-events-replay-port",
            "5558",
            "--kv-block-size",
            "32",
        ]
    )
    s = settings_from_args(args)
    assert (s.prefill_kv_events_port, s.prefill_kv_events_replay_port) == (5557, 5558)
    assert s.kv_block_size == 32


# --- a real gateway process -----------------------------------------------------------------


class Backend:
    """Stands in for a decode sidecar: ready, and answers completions with the path hint
    the gateway sent it."""

    def __init__(self) -> None:
        self.hints: list = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        headers = dict(scope["headers"])
        body = {}
        if scope["path"] == "/v1/completions":
            hint = headers.get(b"x-pdpool-kv-path", b"").decode() or None
            self.hints.append(hint)
            body = {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}], "hint": hint}
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})


@pytest.mark.slow  # a gateway process
async def test_gateway_subscribes_to_the_engines_its_decode_service_lists(servers):
    backend = Backend()
    sidecar = await servers(backend)
    pub, port, replay_port = publisher()
    gw_port = free_port()
    proc = subprocess.Popen(
        pdpool_command(
            "gateway",
            "--host",
            "127.0.0.1",
            "--port",
            str(gw_port),
            "--decode-service",
            f"localhost:{sidecar.port}",  # DNS, as a headless Service
            "--kv-events-port",
            str(port),
            "--kv-events-replay-port",
            str(replay_port),
            "--kv-block-size",
            str(BS),
            "--kv-threshold",
            "0.5",
            "--health-interval-s",
            "0.5",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{gw_port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            deadline = time.monotonic() + 20
            hint = None
            while hint != "decode":
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, f"no precise route; hints {backend.hints}"
                store(pub, PROMPT)  # the engine caches the prompt
                try:
                    r = await client.post(
                        "/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 1}
                    )
                    hint = r.json().get("hint") if r.status_code == 200 else None
                except httpx.TransportError:  # not listening yet
                    pass
                await asyncio.sleep(0.2)
            # A prompt the engine does not hold: predicted below the threshold, P/D first.
            r = await client.post(
                "/v1/completions",
                json={"model": "m", "max_tokens": 1, "prompt": list(range(7, 39))},
            )
            assert r.json()["hint"] == "pd"
        assert metric(url, "pdpool_gateway_kv_routes_total", 'mode="precise"') >= 2
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        pub.close()
