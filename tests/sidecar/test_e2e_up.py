"""End to end on the real topology (`pdpool up`'s processes: prefill and decode engines,
a sidecar, the gateway) with the official `openai` client, for tiny Qwen3 and Qwen3.5."""
from __future__ import annotations

import httpx
import openai
import pytest

from .e2e_helpers import cleanup, metric, model_name, start_topology

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful assistant. " * 8


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def topo(request, tmp_path_factory):
    t = start_topology(tmp_path_factory, arch=request.param, prefill=1, decode=1,
                       cache_hit_threshold=0.5)
    yield t
    cleanup(t, keep_logs=request.node.session.testsfailed > 0)


@pytest.fixture(scope="module")
def urls(topo):
    return {"gateway": topo.gateway.url, "sidecar": topo.by_role("sidecar")[0].url,
            "prefill": topo.by_role("prefill")[0].url, "decode": topo.by_role("decode")[0].url}


@pytest.fixture(scope="module")
def client(urls):
    return openai.OpenAI(base_url=urls["gateway"] + "/v1", api_key="none", max_retries=0)


def direct_completion(url, model, **body):
    """The reference: one engine on its own (aggregated), greedy."""
    r = httpx.post(url + "/v1/completions", json={"model": model, "temperature": 0, **body},
                   timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def direct_chat(url, model, messages, max_tokens):
    r = httpx.post(url + "/v1/chat/completions",
                   json={"model": model, "messages": messages, "temperature": 0,
                         "max_tokens": max_tokens}, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def test_greedy_outputs_match_one_aggregated_engine(client, urls):
    model = model_name(urls["gateway"])
    for i, prompt in enumerate(["The quick brown fox " * 12, "Once upon a time " * 20]):
        expected = direct_completion(urls["prefill"], model, prompt=prompt, max_tokens=8)
        got = client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                        temperature=0)
        assert got.choices[0].text == expected
        stream = client.completions.create(model=model, prompt=prompt + " again", max_tokens=8,
                                           temperature=0, stream=True)
        streamed = "".join(c.choices[0].text for c in stream if c.choices)
        assert streamed == direct_completion(urls["prefill"], model, prompt=prompt + " again",
                                             max_tokens=8)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Write about the sea. " * 6}]
    expected = direct_chat(urls["prefill"], model, messages, 8)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    usage = [c.usage for c in chunks if c.usage][-1]
    assert usage.completion_tokens == 8 and usage.prompt_tokens > 0


def test_conversation_turns_take_the_expected_paths(client, urls):
    """Turn 1 (cold) is rejected by decode; turn 2 with a short new message is served by
    the decode engine alone; turn 3 with a long new message is rejected again and goes
    through the prefill leg (with the history offered for pulling from decode)."""
    model = model_name(urls["gateway"])
    sidecar = urls["sidecar"]
    messages = [{"role": "system", "content": "Conversation about paths. " + SYSTEM},
                {"role": "user", "content": "Tell me about rivers. " * 8}]
    legs_before = metric(sidecar, "pdpool_sidecar_legs_total", 'leg="prefill"')

    def turn(msgs):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=msgs, max_tokens=6, temperature=0)
        return raw.headers.get("x-pdpool-path"), raw.parse()

    path1, r1 = turn(messages)
    assert path1 in ("pd", "fallback")  # fallback: the engine cannot hand KV over yet
    assert r1.choices[0].message.content == direct_chat(urls["prefill"], model, messages, 6)
    prefill_legs_after_1 = metric(sidecar, "pdpool_sidecar_legs_total", 'leg="prefill"')
    assert prefill_legs_after_1 == legs_before + 1

    messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "And lakes?"}]
    path2, r2 = turn(messages)
    assert path2 == "decode"
    assert metric(sidecar, "pdpool_sidecar_legs_total", 'leg="prefill"') == prefill_legs_after_1
    assert r2.usage.prompt_tokens_details.cached_tokens > r2.usage.prompt_tokens // 2
    assert r2.choices[0].message.content == direct_chat(urls["prefill"], model, messages, 6)

    messages += [{"role": "assistant", "content": r2.choices[0].message.content},
                 {"role": "user", "content": "Now a long story about mountains. " * 40}]
    offered_before = metric(sidecar, "pdpool_sidecar_pull_offered_tokens_total")
    path3, r3 = turn(messages)
    assert path3 in ("pd", "fallback")
    assert metric(sidecar, "pdpool_sidecar_legs_total", 'leg="prefill"') == \
        prefill_legs_after_1 + 1
    assert r3.choices[0].message.content == direct_chat(urls["prefill"], model, messages, 6)
    if path3 == "fallback":
        pytest.skip("engine KV connector does not hand KV over yet: prefill legs fall back "
                    "to decode (paths and outputs checked above; transfer not)")
    # history offered to prefill for pulling, and the client sees a truthful usage
    assert metric(sidecar, "pdpool_sidecar_pull_offered_tokens_total") > offered_before
    assert r3.usage.prompt_tokens_details.cached_tokens > 0
