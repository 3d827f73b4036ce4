"""`pdpool up --kv-events` end to end: decode engines publish KV events, the gateway routes
each request to the sidecar whose engine holds its prefix (even where hash affinity would
pick another) and decides the P/D path up front; the sidecars count no misprediction.
Prefill engines publish too: a sidecar sends the prefill leg to the one holding the prompt."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from tests.support.e2e_helpers import cleanup, metric, model_name, start_topology

# Starts engine processes: the full run's tier, not the fast one.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def topo(tmp_path_factory):
    t = start_topology(tmp_path_factory, prefill=2, decode=2, kv_events=True)
    yield t
    cleanup(t)


def _generate(url: str, path: str, body: dict) -> httpx.Response:
    r = httpx.post(url + path, json={**body, "max_tokens": 2, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _complete(url: str, model: str, prompt) -> httpx.Response:
    return _generate(url, "/v1/completions", {"model": model, "prompt": prompt})


def _chat(url: str, model: str, messages: list[dict]) -> httpx.Response:
    return _generate(url, "/v1/chat/completions", {"model": model, "messages": messages})


def _warm_directly(holders, model: str, rng, n: int = 6) -> list[tuple[list[int], int]]:
    """Each of n prompts sent straight to one of `holders` (in turn), past the gateway and
    sidecars: [(prompt, holder's port)], once their events have had time to arrive."""
    docs = []
    for i in range(n):
        doc = [rng.randrange(3, 500) for _ in range(96)]
        holder = holders[i % len(holders)]
        _complete(holder.url, model, doc)
        docs.append((doc, holder.port))
    time.sleep(0.5)
    return docs


def _continued(doc: list[int], rng) -> list[int]:
    """The prompt with a few new tokens after it: its whole prefix is held somewhere."""
    return doc + [rng.randrange(3, 500) for _ in range(8)]


def _total(servers, name: str, label: str) -> float:
    """A metric summed over servers."""
    return sum(metric(s.url, name, label) for s in servers)


def test_routes_to_the_engine_holding_the_prefix(topo):
    gw = topo.gateway.url
    model = model_name(gw)
    sidecars = topo.by_role("sidecar")
    rng = random.Random(5)
    # Only the KV events can tell the gateway where these prefixes live.
    docs = _warm_directly(sidecars, model, rng)
    for doc, port in docs:
        r = _complete(gw, model, _continued(doc, rng))
        assert r.headers["x-pdpool-backend"].endswith(f":{port}"), r.headers
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 80
    # A prompt nobody holds: P/D up front (hit 0 < threshold 0.5), no decode-first leg.
    _complete(gw, model, [rng.randrange(3, 500) for _ in range(64)])
    assert metric(gw, "pdpool_gateway_kv_routes_total", 'path="decode"') == 6
    assert metric(gw, "pdpool_gateway_kv_routes_total", 'path="pd"') == 1
    hints = {
        o: _total(sidecars, "pdpool_sidecar_kv_path_hints_total", f'outcome="{o}"')
        for o in ("honoured", "correct", "mispredicted")
    }
    assert hints == {"honoured": 1, "correct": 6, "mispredicted": 0}


def test_prefill_legs_go_to_the_prefill_engine_holding_the_prompt(topo):
    gw = topo.gateway.url
    model = model_name(gw)
    prefills = topo.by_role("prefill")
    rng = random.Random(11)
    # No decode engine holds these prompts, so the legs go P/D, and only the prefill
    # engines' events say which one has each.
    docs = _warm_directly(prefills, model, rng)
    sidecars = topo.by_role("sidecar")
    ranked0 = _total(sidecars, "pdpool_sidecar_prefill_ranking_total", 'by="kv"')
    for doc, port in docs:
        r = _complete(gw, model, _continued(doc, rng))
        assert r.headers["x-pdpool-path"] == "pd", r.headers
        assert r.headers["x-pdpool-prefill-endpoint"].endswith(f":{port}"), r.headers
    ranked = _total(sidecars, "pdpool_sidecar_prefill_ranking_total", 'by="kv"')
    assert ranked - ranked0 == len(docs)


def test_chats_are_routed_by_the_tokens_an_engine_renders(topo):
    """The gateway has no chat template: it asks a decode engine's /tokenize, and routes the
    rendered ids like any prompt."""
    gw = topo.gateway.url
    model = model_name(gw)
    sidecars = topo.by_role("sidecar")
    rng = random.Random(23)
    words = ["river", "stone", "bright", "quiet", "market", "window", "seven", "garden"]
    chats = []
    for i in range(6):
        system = " ".join(rng.choice(words) for _ in range(120))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "why?"}]
        holder = sidecars[i % len(sidecars)]
        _chat(holder.url, model, messages)
        chats.append((messages, holder.port))
    time.sleep(0.5)
    asked0 = metric(gw, "pdpool_gateway_kv_engine_tokenize_total", 'result="ok"')
    for messages, port in chats:
        r = _chat(gw, model, messages)
        assert r.headers["x-pdpool-backend"].endswith(f":{port}"), r.headers
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    asked = metric(gw, "pdpool_gateway_kv_engine_tokenize_total", 'result="ok"') - asked0
    assert asked == len(chats)
