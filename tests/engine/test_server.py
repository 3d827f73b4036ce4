"""The OpenAI server of one real `pdpool serve` process."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from devtools.engine_procs import spawned_engine

# Starts engine processes: the full run's tier, not the fast one.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    # 64 blocks x 16 tokens: small enough to test "cannot fit in the KV cache".
    with spawned_engine(
        tiny_qwen3, tmp_path_factory.mktemp("logs"), "--num-kv-blocks", "64"
    ) as eng:
        yield eng


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def model_id(client) -> str:
    return client.models.list().data[0].id


def wait_blocks_free(server, timeout=10.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        used = server.metric("pdpool_kv_blocks_used")
        if used == 0 and server.metric("pdpool_num_requests_running") == 0:
            return used
        time.sleep(0.1)
    return server.metric("pdpool_kv_blocks_used")


def test_completions_stream_and_not_agree(client):
    model = model_id(client)
    full = client.completions.create(
        model=model,
        prompt="Hello world, the quick",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0
    chunks = list(
        client.completions.create(
            model=model,
            prompt="Hello world, the quick",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_and_not_agree(client):
    model = model_id(client)
    msgs = [{"role": "user", "content": "Tell me about the river"}]
    full = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 10
    stream = client.chat.completions.create(
        model=model,
        messages=msgs,
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content


def test_seeded_sampling_is_reproducible_and_stop_strings_cut(client):
    model = model_id(client)
    kw = dict(
        model=model,
        prompt="the cache",
        max_tokens=16,
        temperature=0.9,
        top_p=0.9,
        seed=7,
        extra_body={"ignore_eos": True, "top_k": 50},
    )
    a = client.completions.create(**kw).choices[0].text
    assert a == client.completions.create(**kw).choices[0].text
    greedy = client.completions.create(
        model=model,
        prompt="the cache",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = greedy.choices[0].text
    stop = text[3:6]
    cut = client.completions.create(
        model=model,
        prompt="the cache",
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    kept = client.completions.create(
        model=model,
        prompt="the cache",
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert kept.choices[0].finish_reason == "stop"
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]


@pytest.mark.parametrize(
    "body,status,needle",
    [
        ({"prompt": "hi", "model": "no-such-model"}, 404, "does not exist"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": 7}, 400, "temperature"),
        ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"prompt": "hi", "n": 99}, 400, "n"),
        ({"prompt": "hi", "cache_hit_threshold": 1.5}, 400, "cache_hit_threshold"),
        ({"prompt": "hi", "cache_hit_threshold": "high"}, 400, "cache_hit_threshold"),
        ({"prompt": 12}, 400, "prompt"),
        ({"prompt": [999999]}, 400, "token ids"),
        ({"prompt": ""}, 400, "empty"),
        ({"prompt": "x " * 2000, "max_tokens": 4}, 400, "cannot fit in the KV cache"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "hi", "include_stop_str_in_output": "yes"}, 400, "include_stop_str_in_output"),
    ],
)
def test_bad_input_gets_openai_400(server, body, status, needle):
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status


def test_bad_json_and_bad_chat(server):
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": "hi"})
    assert r.status_code == 400
    # Still serving after all of it.
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200


def _completed(server) -> float:
    """Requests that ran to their max_tokens."""
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdpool_request_success_total{") and 'finished_reason="length"' in line
    )


def test_client_disconnect_aborts_and_frees_blocks(server):
    async def go():
        async with (
            httpx.AsyncClient(timeout=30) as c,
            c.stream(
                "POST",
                f"{server.url}/v1/completions",
                json={
                    "prompt": "the pool " * 20,
                    "max_tokens": 900,
                    "stream": True,
                    "ignore_eos": True,
                },
            ) as resp,
        ):
            n = 0
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    n += 1
                if n >= 3:
                    break  # leave mid-stream
        # A non-streaming client that gives up early.
        async with httpx.AsyncClient(timeout=0.5) as c:
            with pytest.raises(httpx.TimeoutException):
                await c.post(
                    f"{server.url}/v1/completions",
                    json={"prompt": "the pool", "max_tokens": 900, "ignore_eos": True},
                )

    aborted0 = server.metric("pdpool_requests_aborted_total")
    finished0 = _completed(server)
    asyncio.run(go())
    assert wait_blocks_free(server) == 0
    # The streaming client is aborted in the engine. The impatient one too, unless it left
    # before its request reached the engine (a busy machine), or its 900 tokens (all the KV
    # this engine has room for) were done before the server noticed it had gone.
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    before_engine = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdpool_client_disconnects_total{") and 'phase="body"' in line
    )
    aborted = server.metric("pdpool_requests_aborted_total") - aborted0
    finished = _completed(server) - finished0
    assert aborted >= 1 and aborted + before_engine + finished >= 2


def test_metrics_and_models(server, client):
    assert client.models.list().data[0].id == "tiny-qwen3"
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "pdpool_num_requests_running",
        "pdpool_num_requests_waiting",
        "pdpool_kv_blocks_used",
        "pdpool_prompt_tokens_total",
        "pdpool_generation_tokens_total",
        "pdpool_time_to_first_token_seconds_bucket",
        "pdpool_inter_token_latency_seconds_bucket",
        "pdpool_prefix_cache_hits_total",
    ):
        assert name in text, name
