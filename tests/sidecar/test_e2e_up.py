"""End to end on the real topology (`pdpool up`'s processes: prefill and decode engines,
a sidecar, the gateway) with the official `openai` client, for tiny Qwen3 and Qwen3.5."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.e2e_helpers import cleanup, metric, model_name, start_topology

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful assistant. " * 8


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def topo(request, tmp_path_factory):
    t = start_topology(
        tmp_path_factory, arch=request.param, prefill=1, decode=1, cache_hit_threshold=0.5
    )
    yield t
    cleanup(t, keep_logs=request.node.session.testsfailed > 0)


@pytest.fixture(scope="module")
def urls(topo):
    return {
        "gateway": topo.gateway.url,
        "sidecar": topo.by_role("sidecar")[0].url,
        "prefill": topo.by_role("prefill")[0].url,
        "decode": topo.by_role("decode")[0].url,
    }


@pytest.fixture(scope="module")
def client(urls):
    return openai.OpenAI(base_url=urls["gateway"] + "/v1", api_key="none", max_retries=0)


def direct_completion(url, model, **body):
    """The reference: one engine on its own (aggregated), greedy."""
    r = httpx.post(
        url + "/v1/completions", json={"model": model, "temperature": 0, **body}, timeout=120
    )
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def direct_chat(url, model, messages, max_tokens):
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens},
        timeout=120,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def test_greedy_outputs_match_one_aggregated_engine(client, urls):
    model = model_name(urls["gateway"])
    for prompt in ["The quick brown fox " * 12, "Once upon a time " * 20]:
        expected = direct_completion(urls["prefill"], model, prompt=prompt, max_tokens=8)
        got = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        assert got.choices[0].text == expected
        stream = client.completions.create(
            model=model, prompt=prompt + " again", max_tokens=8, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].text for c in stream if c.choices)
        assert streamed == direct_completion(
            urls["prefill"], model, prompt=prompt + " again", max_tokens=8
        )
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Write about the sea. " * 6},
    ]
    expected = direct_chat(urls["prefill"], model, messages, 8)
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    usage = [c.usage for c in chunks if c.usage][-1]
    assert usage.completion_tokens == 8 and usage.prompt_tokens > 0


def arch_of(topo) -> str:
    return "qwen3_5" if "tiny-qwen3_5" in topo.spec.model else "qwen3"


def test_conversation_turns_take_the_expected_paths(client, urls, topo):
    """Turn 1 (cold) is rejected by decode and prefilled remotely; turn 2 with a short
    new message is served by the decode engine alone; turn 3 with a long new message is
    rejected again and goes through the prefill leg."""
    model = model_name(urls["gateway"])
    sidecar = urls["sidecar"]
    messages = [
        {"role": "system", "content": "Conversation about paths. " + SYSTEM},
        {"role": "user", "content": "Tell me about rivers. " * 8},
    ]
    legs_before = metric(sidecar, "pdpool_sidecar_legs_total", 'leg="prefill"')

    def turn(msgs):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=msgs, max_tokens=6, temperature=0
        )
        return raw.headers.get("x-pdpool-path"), raw.parse()

    pd_path = "pd" if topo_connector(urls) != "none" else "fallback"
    path1, r1 = turn(messages)
    assert path1 == pd_path
    assert r1.choices[0].message.content == direct_chat(urls["prefill"], model, messages, 6)
    prefill_legs_after_1 = metric(sidecar, "pdpool_sidecar_legs_total", 'leg="prefill"')
    assert prefill_legs_after_1 == legs_before + 1

    messages += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And lakes?"},
    ]
    path2, r2 = turn(messages)
    assert path2 == "decode"
    assert metric(sidecar, "pdpool_sidecar_legs_total", 'leg="prefill"') == prefill_legs_after_1
    assert r2.usage.prompt_tokens_details.cached_tokens > r2.usage.prompt_tokens // 2
    assert r2.choices[0].message.content == direct_chat(urls["prefill"], model, messages, 6)

    messages += [
        {"role": "assistant", "content": r2.choices[0].message.content},
        {"role": "user", "content": "Now a long story about mountains. " * 40},
    ]
    path3, r3 = turn(messages)
    assert path3 == pd_path
    assert metric(sidecar, "pdpool_sidecar_legs_total", 'leg="prefill"') == prefill_legs_after_1 + 1
    assert r3.choices[0].message.content == direct_chat(urls["prefill"], model, messages, 6)


def test_long_turn_pulls_the_history_from_decode(client, urls, topo):
    """A conversation decode served alone so far (prefill has never seen it) gets a long
    turn: decode rejects it and describes its cached history, the prefill engine pulls
    that history instead of recomputing it, decode pulls the rest back."""
    model = model_name(urls["gateway"])
    sidecar = urls["sidecar"]
    messages = [
        {"role": "system", "content": "Pull test. " + SYSTEM},
        {"role": "user", "content": "Describe a harbor at dawn. " * 8},
    ]
    # The client's own threshold 0 wins over the pool's: decode serves turn 1 alone.
    r1 = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"cache_hit_threshold": 0},
    )
    messages += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Now a long story about mountains. " * 40},
    ]
    before = {
        name: metric(url, "pdpool_kv_connector", 'stat="tokens_pulled"')
        for name, url in (("prefill", urls["prefill"]), ("decode", urls["decode"]))
    }
    offered_before = metric(sidecar, "pdpool_sidecar_pull_offered_tokens_total")
    computed_before = metric(urls["prefill"], "pdpool_computed_tokens_total")
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=6, temperature=0
    )
    r3 = raw.parse()
    computed_on_prefill = metric(urls["prefill"], "pdpool_computed_tokens_total") - computed_before
    assert raw.headers["x-pdpool-path"] == ("pd" if topo_connector(urls) != "none" else "fallback")
    assert r3.choices[0].message.content == direct_chat(urls["prefill"], model, messages, 6)
    if topo_connector(urls) == "none" or arch_of(topo) == "qwen3_5":
        # No connector, or a recurrent-state model (the engine recomputes those instead of
        # transferring them): paths and outputs are all there is to check.
        return
    offered = metric(sidecar, "pdpool_sidecar_pull_offered_tokens_total") - offered_before
    pulled_by_prefill = (
        metric(urls["prefill"], "pdpool_kv_connector", 'stat="tokens_pulled"') - before["prefill"]
    )
    assert offered >= r1.usage.prompt_tokens // 2
    assert pulled_by_prefill == offered
    assert computed_on_prefill <= r3.usage.prompt_tokens - offered + 1
    assert metric(urls["decode"], "pdpool_kv_connector", 'stat="tokens_pulled"') > before["decode"]
    assert r3.usage.prompt_tokens_details.cached_tokens >= offered - 1
    split = r3.usage.prompt_tokens_details.model_extra["pdpool"]
    assert split["prefill"]["pulled"] == offered and split["computed"] == 1
    # Decode's lease on its prefix ended with the prefill's read, not by expiry.
    assert metric(urls["decode"], "pdpool_kv_connector", 'stat="leases_active"') == 0
    assert metric(urls["decode"], "pdpool_kv_connector", 'stat="leases_expired"') == 0


def topo_connector(urls) -> str:
    """'none' when the engines run without a KV connector (no nixl installed)."""
    text = httpx.get(urls["decode"] + "/metrics", timeout=5).text
    return "nixl" if 'stat="bytes_read"' in text else "none"


def test_guided_requests_on_the_pd_path(client, urls):
    """A JSON-schema request and a named tool call prefilled on one engine and decoded on
    another: the grammar lives on the decode side (the prefill leg's one token does not
    matter), and the answer is the aggregated engine's greedy guided answer."""
    import json

    import jsonschema

    model = model_name(urls["gateway"])
    schema = {
        "type": "object",
        "properties": {"lake": {"type": "string", "maxLength": 10}, "deep": {"type": "boolean"}},
        "required": ["lake", "deep"],
    }
    messages = [
        {"role": "system", "content": "Guided on the P/D path. " + SYSTEM},
        {"role": "user", "content": "Name a lake, as JSON. " * 8},
    ]
    body = {
        "messages": messages,
        "max_tokens": 120,
        "temperature": 0,
        "structured_outputs": {"json": schema, "disable_any_whitespace": True},
    }
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,
        max_tokens=120,
        temperature=0,
        extra_body={"structured_outputs": body["structured_outputs"]},
    )
    pd_path = "pd" if topo_connector(urls) != "none" else "fallback"
    assert raw.headers.get("x-pdpool-path") == pd_path
    text = raw.parse().choices[0].message.content
    jsonschema.validate(json.loads(text, strict=False), schema)
    alone = httpx.post(
        urls["prefill"] + "/v1/chat/completions", json={"model": model, **body}, timeout=120
    )
    assert text == alone.json()["choices"][0]["message"]["content"]

    tools = [{"type": "function", "function": {"name": "dive", "parameters": schema}}]
    call = client.chat.completions.create(
        model=model,
        messages=[*messages[:1], {"role": "user", "content": "Dive into a lake. " * 9}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "dive"}},
        max_tokens=120,
        temperature=0,
    )
    args = json.loads(call.choices[0].message.tool_calls[0].function.arguments, strict=False)
    jsonschema.validate(args, schema)
