"""LoRA residency in routing: the metric text's parser (bounded against hostile pages), the
pure scores and orders, and the routing core choosing by them (engines' pages handed in as
a front-end's fetch would return them)."""

from __future__ import annotations

import asyncio
import time

from pdpool.sidecar.net.metrics import GatewayMetrics
from pdpool.sidecar.routing import lora_affinity as la
from pdpool.sidecar.routing.core import Routing
from pdpool.sidecar.routing.lora_metrics_text import (
    MAX_ADAPTERS,
    LoraInfo,
    parse_labels,
    parse_lora_info,
)
from pdpool.sidecar.routing.settings import RoutingSettings

BACKENDS = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"]


def page(running: str = "", waiting: str = "", max_lora: int = 2, base: str = "base") -> str:
    return (
        "# HELP vllm:num_requests_running Number of requests.\n"
        f'vllm:num_requests_running{{engine="0",model_name="{base}"}} 1.0\n'
        "# TYPE vllm:lora_requests_info gauge\n"
        f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{running}",'
        f'waiting_lora_adapters="{waiting}"}} {time.time()}\n'
    )


# --- the parser -------------------------------------------------------------------------
def test_reads_running_waiting_max_and_the_base_model():
    info = parse_lora_info(page("a,b", "c"))
    assert info == LoraInfo(frozenset({"a", "b"}), frozenset({"c"}), 2, "base")


def test_the_newest_label_set_wins_as_vllm_keeps_every_old_one():
    text = (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",'
        'waiting_lora_adapters=""} 100.0\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="new",'
        'waiting_lora_adapters=""} 200.0\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="older",'
        'waiting_lora_adapters=""} 50.0\n'
    )
    assert parse_lora_info(text).running == {"new"}


def test_labels_with_escapes_and_any_order():
    assert parse_labels('b="x\\"y",a="1\\\\2"') == {"b": 'x"y', "a": "1\\2"}
    text = (
        'vllm:lora_requests_info{waiting_lora_adapters="",running_lora_adapters="q",'
        'max_lora="3"} 5\n'
    )
    assert parse_lora_info(text) == LoraInfo(frozenset({"q"}), frozenset(), 3, None)


def test_no_lora_series_is_none():
    assert parse_lora_info("") is None
    assert parse_lora_info("vllm:num_requests_running 3\n") is None


def test_hostile_pages_are_bounded_and_never_raise():
    huge_name = "x" * 100_000
    many = ",".join(f"a{i}" for i in range(MAX_ADAPTERS + 10))
    hostile = [
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a',  # unterminated
        'vllm:lora_requests_info{max_lora="2"} not-a-number',
        'vllm:lora_requests_info{max_lora="2"} NaN',
        'vllm:lora_requests_info{max_lora="-1",running_lora_adapters="a"} 1',
        'vllm:lora_requests_info{max_lora="99999999999",running_lora_adapters="a"} 1',
        'vllm:lora_requests_info{max_lora="0x2",running_lora_adapters="a"} 1',
        'vllm:lora_requests_info{max_lora="2" running_lora_adapters=a} 1',
        "vllm:lora_requests_info{" + 'x="1",' * 100 + "} 1",
        "vllm:lora_requests_info{{{{}}}} 1",
        "vllm:lora_requests_info{=} 1",
        f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{many}"}} 1',
        "\x00\xff" * 1000,
    ]
    for line in hostile:
        assert parse_lora_info(line + "\n") is None, line[:80]
    # a 100 KB adapter name: the line is skipped, not parsed
    long_line = f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{huge_name}"}} 1'
    assert parse_lora_info(long_line) is None
    # a long but legal name is dropped from the set, the rest stands
    name300 = "n" * 300
    got = parse_lora_info(
        f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{name300},ok"}} 1'
    )
    assert got is not None and got.running == {"ok"}
    # thousands of lines of other series, one good one at the end: found, quickly
    noise = "".join(f'vllm:other{{i="{i}"}} {i}\n' for i in range(20_000))
    started = time.perf_counter()
    assert parse_lora_info(noise + page("z")).running == {"z"}
    assert time.perf_counter() - started < 2.0


# --- scores and orders --------------------------------------------------------------------
def info(running=(), waiting=(), max_lora=2) -> LoraInfo:
    return LoraInfo(frozenset(running), frozenset(waiting), max_lora, "base")


def test_score_tiers_follow_gie_with_the_routers_memory():
    assert la.adapter_score("a", info(["a", "b"])) == la.RUNNING
    assert la.adapter_score("a", info(["b"]), ["a"]) == la.RECENT
    free_two = la.adapter_score("a", info())
    free_one = la.adapter_score("a", info(["b"]))
    assert la.FREE < free_one < free_two <= la.FREE + la.FREE_SPAN < la.RECENT
    assert la.adapter_score("a", info(["b", "c"], ["a"])) == la.WAITING
    assert la.adapter_score("a", info(["b", "c"])) == la.FULL
    assert la.adapter_score("a", info(["b"]), ["c"]) == la.FULL  # c still holds a slot
    # the memory is only believed where the running adapters leave it room
    assert la.adapter_score("a", info(["b", "c"]), ["a"]) == la.FULL
    assert la.adapter_score("a", info(["b"]), ["a", "d"]) == la.FULL  # d came after a
    assert la.adapter_score("a", None) == la.UNKNOWN
    assert la.WAITING < la.UNKNOWN < la.FREE


def test_order_prefers_residency_within_the_load_bound():
    order = ["e1", "e2", "e3", "e4"]
    scores = {"e1": la.FULL, "e2": la.FREE, "e3": la.RUNNING, "e4": la.FREE}
    loads = dict.fromkeys(order, 0)
    got = la.adapter_order(order, scores, loads.__getitem__, lambda b: True, 1.25)
    assert got == ["e3", "e2", "e4", "e1"]  # ties keep prefix affinity's order
    loads["e3"] = 6  # badly overloaded: cap = ceil(1.25 * 7 / 4) = 3
    got = la.adapter_order(order, scores, loads.__getitem__, lambda b: True, 1.25)
    assert got[0] == "e2" and got[-1] == "e3"
    got = la.adapter_order(order, scores, loads.__getitem__, lambda b: b != "e2", 1.25)
    assert got[0] == "e4"  # an unhealthy engine is never preferred


def test_adapter_cost_is_bounded_by_load():
    scores = {"e1": la.RUNNING, "e2": la.FULL}
    loads = {"e1": 0, "e2": 0}
    cost = la.adapter_cost(scores, ["e1", "e2"], loads.__getitem__, 1.25, 256)
    assert cost("e1") == 0 and cost("e2") == 256
    loads["e1"] = 10
    cost = la.adapter_cost(scores, ["e1", "e2"], loads.__getitem__, 1.25, 256)
    assert cost("e1") == 256  # no adapter credit above the cap


def test_memory_keeps_the_last_max_lora_known_adapters():
    clock = [0.0]
    res = la.LoraResidency(lambda: ["e1"], clock=lambda: clock[0])
    res.update("e1", page("a,b", max_lora=2))
    res.update("e1", page("", max_lora=2))
    for name in ("a", "b", "a", "made-up"):
        res.routed("e1", name)
    assert list(res.recent["e1"]) == ["b", "a"]  # made-up names are never remembered
    assert res.applies("a") and res.applies("never-listed") and not res.applies("base")
    clock[0] = 60.0  # the reading aged out: nothing is scored as an adapter then
    assert not res.applies("a")


def test_a_pool_without_lora_series_is_read_seldom():
    pages: dict[str, object] = {"e1": None}  # None: unreadable (still starting)

    async def fetch(backend: str):
        return pages[backend]

    async def run():
        res = la.LoraResidency(lambda: ["e1"], interval_s=0.5)
        res.fetch = fetch
        await res.scrape_once()
        assert res.next_interval_s() == 0.5  # not read: soon again
        pages["e1"] = "vllm:num_requests_running 0\n"
        await res.scrape_once()
        assert res.next_interval_s() == la.IDLE_INTERVAL_S  # read, no LoRA: seldom
        pages["e1"] = page("a")
        await res.scrape_once()
        assert res.next_interval_s() == 0.5

    asyncio.run(run())


# --- the routing core ---------------------------------------------------------------------
def make(pages: dict[str, str], **overrides) -> Routing:
    settings = RoutingSettings(decode_urls=list(BACKENDS), health_interval_s=3600, **overrides)
    return Routing(settings, GatewayMetrics())


async def started(routing: Routing, pages: dict[str, str]) -> Routing:
    async def probe(backend: str) -> bool:
        return True

    async def fetch(backend: str):
        return pages.get(backend)

    await routing.start(probe, None, fetch)
    return routing


def body(model: str, text: str) -> dict:
    return {"model": model, "prompt": text, "max_tokens": 4}


def test_core_sends_an_adapter_where_it_runs_and_avoids_full_engines():
    pages = {b: page() for b in BACKENDS}
    pages[BACKENDS[2]] = page("alpha")
    pages[BACKENDS[0]] = page("x,y")
    pages[BACKENDS[1]] = page("x,y")
    pages[BACKENDS[3]] = page("x,y")

    async def run():
        routing = await started(make(pages), pages)
        try:
            for i in range(20):  # whatever the prompt's prefix owner
                got = await routing.route(body("alpha", f"prompt {i} " * 20), {})
                assert got.order[0] == BACKENDS[2]
            # beta runs nowhere; only BACKENDS[2] has a free slot
            got = await routing.route(body("beta", "some prompt " * 20), {})
            assert got.order[0] == BACKENDS[2]
            # the base model is routed by prefix affinity alone
            plain = make({}, lora_affinity=False)
            await started(plain, {})
            try:
                for i in range(10):
                    text = f"base prompt {i} " * 20
                    assert (await routing.route(body("base", text), {})).order == (
                        await plain.route(body("base", text), {})
                    ).order
            finally:
                await plain.stop()
            metric = routing.metrics.render().decode()
            assert 'pdpool_gateway_lora_routes_total{residency="running"} 20.0' in metric
        finally:
            await routing.stop()

    asyncio.run(run())


def test_core_spills_an_overloaded_resident_engine():
    pages = {b: page() for b in BACKENDS}
    pages[BACKENDS[1]] = page("alpha")

    async def run():
        routing = await started(make(pages), pages)
        try:
            owner = BACKENDS[1]
            with routing.tracked(owner), routing.tracked(owner), routing.tracked(owner):
                got = await routing.route(body("alpha", "hot " * 30), {})
                assert got.order[0] != owner  # cap = ceil(1.25 * 4 / 4) = 2
            assert (await routing.route(body("alpha", "hot " * 30), {})).order[0] == owner
        finally:
            await routing.stop()

    asyncio.run(run())


def test_core_survives_hostile_pages():
    pages = {
        BACKENDS[0]: "vllm:lora_requests_info{" + "a" * 200_000,
        BACKENDS[1]: "\n".join(
            f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="a{i}"}} {i}'
            for i in range(5000)
        ),
        BACKENDS[2]: "garbage\x00" * 10_000,
        BACKENDS[3]: page("alpha"),
    }

    async def run():
        routing = await started(make(pages), pages)
        try:
            got = await routing.route(body("alpha", "x " * 50), {})
            assert got.order[0] == BACKENDS[3]
            assert sorted(got.order) == sorted(BACKENDS)
            # the many-series page: the newest one is believed (a4999), nothing more
            assert routing.lora is not None
            assert routing.lora.info(BACKENDS[1]).running == {"a4999"}
        finally:
            await routing.stop()

    asyncio.run(run())


# --- the front-ends' read of a page -------------------------------------------------------
def metrics_app(text: bytes):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for at in range(0, len(text), 1 << 20):  # streamed in 1 MiB pieces
            await send(
                {"type": "http.response.body", "body": text[at : at + (1 << 20)], "more_body": True}
            )
        await send({"type": "http.response.body", "body": b""})

    return app


async def test_an_engine_page_is_read_bounded(servers):
    import httpx

    from pdpool.sidecar.routing.backends import MAX_METRICS_BYTES, Backends

    good = await servers(metrics_app(page("alpha").encode()))
    huge = await servers(metrics_app(b"#" * (MAX_METRICS_BYTES + 1)))
    backends = Backends(None, False, 5.0)
    backends.client = httpx.AsyncClient()
    try:
        text = await backends.engine_metrics(good.host_port)
        assert text is not None and parse_lora_info(text).running == {"alpha"}
        assert await backends.engine_metrics(huge.host_port) is None
    finally:
        await backends.client.aclose()
