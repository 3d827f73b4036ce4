"""Hostile request bodies against a real engine, its sidecar and the gateway (one `pdpool up`
topology for the module): every one gets an OpenAI-shaped 4xx from each server, never a 5xx
or a hang, and every server is healthy (and serves) afterwards."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.e2e_helpers import cleanup, start_topology

pytestmark = pytest.mark.slow

MIB = 1 << 20


def j(obj) -> bytes:
    return json.dumps(obj).encode()


def c(**fields) -> bytes:
    """A completions body: a valid one plus `fields`."""
    return j({"prompt": "hello", "max_tokens": 2, **fields})


def chat(**fields) -> bytes:
    return j({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields})


CHAT = "/v1/chat/completions"
# (id, route, raw body, expected status). Each is sent to the engine, the sidecar and the
# gateway alike.
HOSTILE = [
    # --- encodings -------------------------------------------------------------------
    ("invalid-utf8", None, b'{"prompt": "\xff\xfe"}', 400),
    ("invalid-utf8-chat", CHAT, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', 400),
    ("utf8-encoded-surrogate", None, b'{"prompt": "\xed\xa0\x80"}', 400),
    ("lone-surrogate", None, b'{"prompt": "\\ud800"}', 400),
    ("lone-low-surrogate", None, b'{"prompt": "abc\\udc00def"}', 400),
    ("lone-surrogate-chat", CHAT, b'{"messages": [{"role": "user", "content": "x\\ud800"}]}', 400),
    ("lone-surrogate-key", None, b'{"prompt": "x", "\\ud800": 1}', 400),
    ("lone-surrogate-stop", None, b'{"prompt": "x", "stop": ["\\udfff"]}', 400),
    ("utf16-body", None, '{"prompt": "x"}'.encode("utf-16"), 400),
    ("bom", None, b"\xef\xbb\xbf" + c(), 400),
    ("nul-bytes", None, b"\x00" * 64, 400),
    ("latin1-body", None, '{"prompt": "caf\xe9"}'.encode("latin-1"), 400),
    # --- JSON syntax and shape ------------------------------------------------------------
    ("empty", None, b"", 400),
    ("not-json", None, b"{not json", 400),
    ("truncated", None, b'{"prompt": "x"', 400),
    ("array", None, b"[1, 2]", 400),
    ("string", None, b'"prompt"', 400),
    ("number", None, b"42", 400),
    ("null", None, b"null", 400),
    ("nan", None, b'{"prompt": "x", "temperature": NaN}', 400),
    ("infinity", None, b'{"prompt": "x", "top_p": Infinity}', 400),
    ("huge-int-literal", None, b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}", 400),
    ("nested-5k", None, b"[" * 5000 + b"]" * 5000, 400),
    ("nested-5k-objects", None, b'{"a":' * 5000 + b"1" + b"}" * 5000, 400),
    ("nested-in-field", None, b'{"prompt": "x", "user": ' + b"[" * 100 + b"]" * 100 + b"}", 400),
    ("nested-prompt", None, b'{"prompt": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}", 400),
    # --- types (strict, as OpenAI's schema) ---------------------------------------------
    ("stream-string", None, c(stream="yes"), 400),
    ("stream-int", None, c(stream=1), 400),
    ("stream-chat-string", CHAT, chat(stream="true"), 400),
    ("max-tokens-string", None, c(max_tokens="16"), 400),
    ("max-tokens-float", None, c(max_tokens=16.5), 400),
    ("max-tokens-bool", None, c(max_tokens=True), 400),
    ("max-completion-tokens-string", CHAT, chat(max_completion_tokens="4"), 400),
    ("min-tokens-string", None, c(min_tokens="1"), 400),
    ("prompt-bools", None, j({"prompt": [True, False]}), 400),
    ("prompt-int", None, j({"prompt": 12}), 400),
    ("prompt-null", None, j({"prompt": None}), 400),
    ("prompt-object", None, j({"prompt": {"text": "x"}}), 400),
    ("prompt-floats", None, j({"prompt": [1.5, 2.0]}), 400),
    ("prompt-mixed", None, j({"prompt": ["a", 3]}), 400),
    ("prompt-nested-bools", None, j({"prompt": [[1, True]]}), 400),
    ("prompt-missing", None, j({"max_tokens": 3}), 400),
    ("temperature-string", None, c(temperature="1"), 400),
    ("temperature-bool", None, c(temperature=True), 400),
    ("top-p-string", None, c(top_p="0.5"), 400),
    ("top-k-float", None, c(top_k=5.5), 400),
    ("seed-float", None, c(seed=1.5), 400),
    ("seed-string", None, c(seed="7"), 400),
    ("n-bool", None, c(n=True), 400),
    ("stop-int", None, c(stop=5), 400),
    ("stop-list-of-ints", None, c(stop=[1, 2]), 400),
    ("stop-token-ids-strings", None, c(stop_token_ids=["1"]), 400),
    ("stop-token-ids-bools", None, c(stop_token_ids=[True]), 400),
    ("ignore-eos-string", None, c(ignore_eos="yes"), 400),
    ("stream-options-list", None, c(stream=True, stream_options=[]), 400),
    ("include-usage-string", None, c(stream=True, stream_options={"include_usage": "y"}), 400),
    ("stream-options-no-stream", None, c(stream_options={"include_usage": True}), 400),
    ("truncate-zero", None, c(truncate_prompt_tokens=0), 400),
    ("prompt-logprobs-streamed", None, c(prompt_logprobs=1, stream=True), 400),
    ("prompt-logprobs-chat-negative", CHAT, chat(prompt_logprobs=-2), 400),
    ("prompt-logprobs-string", None, c(prompt_logprobs="1"), 400),
    ("prompt-logprobs-all", None, c(prompt_logprobs=-1), 400),
    ("prompt-logprobs-over-the-limit", CHAT, chat(prompt_logprobs=21), 400),
    ("return-token-offsets", None, c(return_token_offsets=True), 400),
    ("logprob-token-ids", None, c(logprob_token_ids=[5]), 400),
    ("truncate-minus-two", None, c(truncate_prompt_tokens=-2), 400),
    ("truncate-string", CHAT, chat(truncate_prompt_tokens="5"), 400),
    ("truncate-huge", None, c(truncate_prompt_tokens=2**63), 400),
    ("truncation-side-bad", None, c(truncate_prompt_tokens=5, truncation_side="middle"), 400),
    ("stream-options-stream-false", CHAT, chat(stream=False, stream_options={"x": 1}), 400),
    ("threshold-string", None, c(cache_hit_threshold="0.5"), 400),
    ("threshold-bool", None, c(cache_hit_threshold=True), 400),
    ("model-int", None, c(model=5), 400),
    ("cache-salt-int", None, c(cache_salt=5), 400),
    ("user-int", None, c(user=5), 400),
    ("messages-string", CHAT, j({"messages": "hi"}), 400),
    ("messages-empty", CHAT, j({"messages": []}), 400),
    ("messages-missing", CHAT, j({"max_tokens": 3}), 400),
    ("message-not-object", CHAT, j({"messages": ["hi"]}), 400),
    ("role-int", CHAT, j({"messages": [{"role": 1, "content": "hi"}]}), 400),
    ("role-missing", CHAT, j({"messages": [{"content": "hi"}]}), 400),
    ("content-int", CHAT, j({"messages": [{"role": "user", "content": 5}]}), 400),
    (
        "content-image",
        CHAT,
        j(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    }
                ]
            }
        ),
        400,
    ),
    (
        "content-part-text-int",
        CHAT,
        j({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
        400,
    ),
    ("logprobs-chat-string", CHAT, chat(logprobs="yes"), 400),
    # --- ranges ---------------------------------------------------------------------------
    ("seed-2^64", None, c(seed=2**64, temperature=1), 400),
    ("seed-below-int64", None, c(seed=-(2**63) - 1, temperature=1), 400),
    ("seed-plus-n-overflows", None, c(seed=2**64 - 1, n=2, temperature=1), 400),
    ("stop-token-out-of-vocab", None, c(min_tokens=1, stop_token_ids=[999999]), 400),
    ("stop-token-2^70", None, c(min_tokens=1, stop_token_ids=[2**70]), 400),
    ("stop-token-negative", None, c(stop_token_ids=[-1]), 400),
    ("prompt-token-out-of-vocab", None, j({"prompt": [999999], "max_tokens": 2}), 400),
    ("prompt-token-2^70", None, j({"prompt": [2**70], "max_tokens": 2}), 400),
    ("prompt-token-negative", None, j({"prompt": [-5], "max_tokens": 2}), 400),
    ("temperature-1e-300", None, c(temperature=1e-300), 400),
    ("temperature-tiny", None, c(temperature=0.001), 400),
    ("temperature-negative", None, c(temperature=-1), 400),
    ("temperature-huge", None, c(temperature=1e308), 400),
    ("top-p-zero", None, c(top_p=0), 400),
    ("top-p-above-one", None, c(top_p=1.5), 400),
    ("top-k-minus-two", None, c(top_k=-2), 400),
    ("max-tokens-zero", None, c(max_tokens=0), 400),
    ("max-tokens-negative", None, c(max_tokens=-3), 400),
    ("min-tokens-negative", None, c(min_tokens=-1), 400),
    ("min-tokens-above-max", None, c(min_tokens=5, max_tokens=2), 400),
    ("min-tokens-above-default", None, j({"prompt": "x", "min_tokens": 100}), 400),
    ("n-zero", None, c(n=0), 400),
    ("stop-empty-string", None, c(stop=[""]), 400),
    ("too-many-stops", None, c(stop=[f"s{i}" for i in range(9)]), 400),
    ("threshold-above-one", None, c(cache_hit_threshold=1.5), 400),
    ("prompt-empty", None, j({"prompt": "", "max_tokens": 2}), 400),
    ("prompt-too-long", None, j({"prompt": "x " * 3000, "max_tokens": 2}), 400),
    ("max-tokens-beyond-context", None, c(max_tokens=10**9), 400),
    ("wrong-model", None, c(model="no-such-model"), 404),
    # --- features this server does not implement ------------------------------------------
    ("best-of", None, c(best_of=2), 400),
    # implemented, so refused only for bad values
    ("logit-bias-out-of-range", None, c(logit_bias={"1": 500}), 400),
    ("presence-penalty-out-of-range", None, c(presence_penalty=2.5), 400),
    ("frequency-penalty-out-of-range", None, c(frequency_penalty=-3), 400),
    ("repetition-penalty-zero", None, c(repetition_penalty=0), 400),
    ("repetition-penalty-a-string", None, c(repetition_penalty="1.2"), 400),
    ("min-p-above-one", None, c(min_p=1.5), 400),
    ("allowed-token-ids-empty", None, c(allowed_token_ids=[]), 400),
    ("allowed-token-ids-beyond-the-vocabulary", None, c(allowed_token_ids=[10**6]), 400),
    ("allowed-token-ids-negative", None, c(allowed_token_ids=[-1]), 400),
    # lists the engine scans every step or masks by: capped
    ("stop-token-ids-2000", None, c(stop_token_ids=[1] * 2000), 400),
    ("allowed-token-ids-20000", None, c(allowed_token_ids=[1] * 20000), 400),
    ("response-format-unknown", CHAT, chat(response_format={"type": "xml"}), 400),
    ("tools-without-function", CHAT, chat(tools=[{"type": "function"}]), 400),
    ("tool-choice", CHAT, chat(tool_choice="required"), 400),
    ("functions", CHAT, chat(functions=[{"name": "f"}]), 400),
    ("function-call", CHAT, chat(function_call="auto"), 400),
    ("suffix", None, c(suffix="end"), 400),
    ("echo-with-logprobs-over-the-limit", None, c(echo=True, logprobs=21), 400),
    ("guided-json-not-a-schema", None, c(guided_json={"type": "objekt"}), 400),
    ("beam-search", None, c(use_beam_search=True), 400),
    # --- sizes ----------------------------------------------------------------------------
    ("body-40mb", None, b'{"prompt": "' + b"a" * (40 * MIB) + b'"}', 413),
]


@pytest.fixture(scope="module")
def topo(tmp_path_factory):
    t = start_topology(tmp_path_factory, prefill=0, decode=1, mode="aggregated")
    try:
        yield t
    finally:
        cleanup(t)


@pytest.fixture(scope="module")
def targets(topo):
    """name -> base URL of the engine, the sidecar in front of it, and the gateway."""
    return {
        "engine": topo.by_role("decode")[0].url,
        "sidecar": topo.by_role("sidecar")[0].url,
        "gateway": topo.gateway.url,
    }


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=httpx.Timeout(30.0, connect=5.0)) as c:
        yield c


def test_the_list_is_long_enough():
    assert len(HOSTILE) >= 100 and len({h[0] for h in HOSTILE}) == len(HOSTILE)


@pytest.mark.parametrize("name,route,raw,status", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_body_gets_openai_4xx_everywhere(targets, client, name, route, raw, status):
    path = route or "/v1/completions"
    for server, url in targets.items():
        r = client.post(url + path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == status, f"{server}: {r.status_code} {r.text[:300]}"
        err = r.json()["error"]
        assert err["message"] and err["code"] == status, (server, err)
        assert err["type"] in (
            "BadRequestError",
            "invalid_request_error",
            "NotFoundError",
            "not_found_error",
        ), (server, err)


def test_empty_stream_options_without_a_stream_are_accepted(targets, client):
    """As vLLM: only options that say something need `stream: true`."""
    for server, url in targets.items():
        for options in ({}, None):
            r = client.post(
                url + "/v1/completions",
                content=c(stream_options=options),
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 200, (server, options, r.text[:300])


def test_chunked_body_over_the_limit_is_refused_while_it_arrives(targets, client):
    """No content-length announced: the limit is enforced on the bytes as they come."""

    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * MIB
        yield b'"}'

    for server, url in targets.items():
        r = client.post(
            url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413, f"{server}: {r.status_code} {r.text[:200]}"


def test_every_server_stays_healthy_and_serves(targets, client):
    for server, url in targets.items():
        for probe in ("/health", "/ready"):
            assert client.get(url + probe).status_code == 200, (server, probe)
        r = client.post(
            url + "/v1/completions",
            json={"prompt": "still serving", "max_tokens": 3, "temperature": 0},
        )
        assert r.status_code == 200, (server, r.text[:300])
        assert r.json()["usage"]["completion_tokens"] >= 1


def _exchange(url: str, heads: list[bytes]) -> list[tuple[int, bytes]]:
    """Sends one completion per extra head on one keep-alive connection, each answer read
    before the next is sent: (status, body) of each (status 0: the connection was closed)."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    body = c()
    answers = []
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        reader = sock.makefile("rb")
        for extra in heads:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                + extra
                + b"content-length: %d\r\n\r\n" % len(body)
                + body
            )
            status_line = reader.readline()
            if not status_line:
                answers.append((0, b""))
                break
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            answers.append((int(status_line.split()[1]), reader.read(length)))
    return answers


def test_a_request_head_over_a_mib_gets_431_and_heads_under_it_are_served(targets):
    """The head is bounded as it arrives (a header is counted before it is complete); one
    keep-alive connection's heads are each counted on their own."""
    for server, url in targets.items():
        ((status, body),) = _exchange(url, [b"x-big: " + b"a" * (1100 * 1024) + b"\r\n"])
        assert status == 431, (server, body[:200])
        error = json.loads(body)["error"]
        assert error["code"] == 431 and "exceed" in error["message"], (server, error)
        under = b"x-big: " + b"a" * (600 * 1024) + b"\r\n"
        answers = _exchange(url, [under, under])
        assert [s for s, _ in answers] == [200, 200], (server, answers[-1][1][:200])
