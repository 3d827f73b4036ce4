"""`pdpool up --kv-events` end to end: decode engines publish KV events, the gateway routes
each request to the sidecar whose engine holds its prefix (even where hash affinity would
pick another) and decides the P/D path up front; the sidecars count no misprediction.
Prefill engines publish too: a sidecar sends the prefill leg to the one holding the prompt."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.support.e2e_helpers import (
    await_indexed,
    blocks_known,
    cleanup,
    log_warnings,
    metric,
    model_name,
    settled_blocks,
    start_topology,
)

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


BLOCK = 16  # the engines' default block size
DOC_TOKENS = 96


def _warm_directly(
    holders, model: str, rng, routers, blocks_metric: str, n: int = 6
) -> list[tuple[list[int], int]]:
    """Each of n prompts sent straight to one of `holders` (in turn), past the gateway and
    sidecars: [(prompt, holder's port)], once every router's KV index (`blocks_metric` on
    each of `routers`) has the blocks their events announced."""
    before = settled_blocks(routers, blocks_metric)
    docs = []
    for i in range(n):
        doc = [rng.randrange(3, 500) for _ in range(DOC_TOKENS)]
        holder = holders[i % len(holders)]
        _complete(holder.url, model, doc)
        docs.append((doc, holder.port))
    grown = {
        (r.port, f"127.0.0.1:{h.port}"): sum(1 for _, p in docs if p == h.port)
        * (DOC_TOKENS // BLOCK)
        for r in routers
        for h in holders
    }
    await_indexed(routers, blocks_metric, before, grown)
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
    docs = _warm_directly(sidecars, model, rng, [topo.gateway], "pdpool_gateway_kv_blocks")
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
    sidecars = topo.by_role("sidecar")
    docs = _warm_directly(prefills, model, rng, sidecars, "pdpool_sidecar_prefill_kv_blocks")
    ranked0 = _total(sidecars, "pdpool_sidecar_prefill_ranking_total", 'by="kv"')
    clean = 0
    for doc, port in docs:
        trouble0 = _prefill_trouble(sidecars)
        r = _complete(gw, model, _continued(doc, rng))
        assert r.headers["x-pdpool-path"] == "pd", r.headers
        if _prefill_trouble(sidecars) != trouble0:
            continue  # a failed leg or an ejection sends it on past the holder, rightly
        clean += 1
        went = r.headers["x-pdpool-prefill-endpoint"]
        if not went.endswith(f":{port}"):
            _explain_miss(r, sidecars)
        assert went.endswith(f":{port}"), f"the leg went to {went}, not :{port} (printed above)"
    # A loaded machine may fail a probe or a leg now and then, not most of them.
    assert clean >= len(docs) - 2, f"{len(docs) - clean} legs met a failure or an ejection"
    ranked = _total(sidecars, "pdpool_sidecar_prefill_ranking_total", 'by="kv"')
    assert ranked - ranked0 >= clean


def _explain_miss(r: httpx.Response, sidecars) -> None:
    """Prints (shown whole with the failure, unlike an assertion message) what the
    sidecars knew when a leg missed the holder."""
    print("answer headers:", {k: v for k, v in r.headers.items() if k.startswith("x-")})
    print("blocks known:", blocks_known(sidecars, "pdpool_sidecar_prefill_kv_blocks"))
    names = (
        "pdpool_sidecar_prefill_ranking_total",
        "pdpool_sidecar_prefill_attempts_total",
        "pdpool_sidecar_prefill_ejections_total",
        "pdpool_sidecar_prefill_other_revision_skipped_total",
    )
    for sc in sidecars:
        text = httpx.get(sc.url + "/metrics", timeout=5).text
        print(sc.name, [ln for ln in text.splitlines() if ln.startswith(names)])
    print("warnings:", log_warnings(sidecars))


FAILED_LEGS = ("timeout", "connect_error", "server_error", "ejected")


def _prefill_trouble(sidecars) -> dict[str, float]:
    """The sidecars' failed prefill legs by outcome, and their ejections of prefill engines
    (an ejected engine is not ranked at all)."""
    out = {
        o: _total(sidecars, "pdpool_sidecar_prefill_attempts_total", f'outcome="{o}"')
        for o in FAILED_LEGS
    }
    out["ejections"] = _total(sidecars, "pdpool_sidecar_prefill_ejections_total", "")
    return out


def test_chats_are_routed_by_the_tokens_an_engine_renders(topo):
    """The gateway has no chat template: it asks a decode engine's /tokenize, and routes the
    rendered ids like any prompt."""
    gw = topo.gateway.url
    model = model_name(gw)
    sidecars = topo.by_role("sidecar")
    rng = random.Random(23)
    words = ["river", "stone", "bright", "quiet", "market", "window", "seven", "garden"]
    chats = []
    before = settled_blocks([topo.gateway], "pdpool_gateway_kv_blocks")
    for i in range(6):
        system = " ".join(rng.choice(words) for _ in range(120))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "why?"}]
        holder = sidecars[i % len(sidecars)]
        _chat(holder.url, model, messages)
        chats.append((messages, holder.port))
    # The system prompt alone is over 120 tokens: at least 7 blocks per chat.
    grown = {
        (topo.gateway.port, f"127.0.0.1:{h.port}"): 7 * sum(1 for _, p in chats if p == h.port)
        for h in sidecars
    }
    await_indexed([topo.gateway], "pdpool_gateway_kv_blocks", before, grown)
    asked0 = metric(gw, "pdpool_gateway_kv_engine_tokenize_total", 'result="ok"')
    for messages, port in chats:
        r = _chat(gw, model, messages)
        assert r.headers["x-pdpool-backend"].endswith(f":{port}"), r.headers
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    asked = metric(gw, "pdpool_gateway_kv_engine_tokenize_total", 'result="ok"') - asked0
    assert asked == len(chats)
