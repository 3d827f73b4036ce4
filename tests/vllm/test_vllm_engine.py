"""Stock vLLM (CPU build, scripts/vllm/build-venv.sh) as a first-class engine, against the
real thing: no stand-in here.

One topology per module (`pdpool up --engine vllm` as a library: a vLLM prefill engine, a vLLM
decode engine behind our sidecar, our gateway; P/D through vLLM's NixlConnector) and one
`pdpool serve` on the same tiny Qwen3 (head_dim 32: vLLM's CPU attention has no 16):
- vLLM's greedy text equals pdpool serve's;
- through our sidecars and gateway, aggregated, decode-first (decided by length: stock vLLM
  cannot reject) and prefill-first give the same greedy text as one vLLM engine, streaming
  and not, completions and chat, through the official `openai` client;
- a stop string or stop token id ends an answer as in vLLM: the same text, finish_reason and
  stop_reason, streamed and not, completions and chat, from our engine and through the
  gateway;
- echo (completions: the prompt's text before the answer's, with max_tokens 0 the prompt
  alone; chat: the last message's when it has the answer's role) as in vLLM, from our
  engine and through the gateway;
- presence, frequency and repetition penalties, allowed_token_ids and bad_words change
  greedy answers as in vLLM: the same text from our engine and through the gateway (P/D);
- P/D really moved the KV (the decode engine counts prompt tokens from external transfer);
- vLLM's /metrics has the names, types and labels our engine copies;
- vLLM engines join a traced request's trace (`--otlp-traces-endpoint`, as every child of
  `pdpool up` gets it): their llm_request spans hang under our sidecar's legs.
vLLM starts in 45-165 s here, so each server starts once for the module.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import time
from functools import partial

import httpx
import openai
import pytest

from devtools.engine_procs import SpawnedEngine, wait_healthy
from pdpool.otlp_receiver import OtlpReceiver
from tests.support.vllm_metric_names import check_vllm_names
from pdpool.up.topology import (
    SIDE_BY_SIDE,
    Topology,
    TopologySpec,
    free_port,
    pdpool_command,
    served_model_name,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

# A loaded CI machine (load 13 seen) left a vLLM engine's socket unanswered past the
# default 5 s: the sidecars here keep retrying longer than a user's would.
DECODE_RETRY_S = 60.0
MIN_PD_TOKENS = 16  # sidecar: prompts of >= 16 estimated tokens (64 chars) go P/D
SHORT = ["Hello world, the", "Once upon a time", "A cat sat"]
LONG = [
    "The quick brown fox jumps over the lazy dog and then runs far away into the "
    "deep dark forest where nobody ever goes",
    "In a small village by the river there lived an old engine maker who built " * 3,
    " ".join(f"word{i}" for i in range(60)),
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def stack(tiny_qwen3, vllm_bin, tmp_path_factory, receiver):
    logs = tmp_path_factory.mktemp("vllm-logs")
    ours = SpawnedEngine(tiny_qwen3, logs, "--num-kv-blocks", "256")
    topo = Topology(
        TopologySpec(
            model=str(tiny_qwen3),
            engine="vllm",
            vllm_bin=vllm_bin,
            prefill=1,
            decode=1,
            **{**SIDE_BY_SIDE, "decode_retry_s": DECODE_RETRY_S},
            log_dir=str(logs),
            prefill_min_prompt_tokens=MIN_PD_TOKENS,
            prefill_timeout=120.0,
            otlp_traces_endpoint=receiver.endpoint,
            tracing_env={
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                "OTEL_BSP_SCHEDULE_DELAY": "200",
            },
        )
    )
    extra: dict[str, tuple[subprocess.Popen, str]] = {}
    started = time.monotonic()
    try:
        topo.start(timeout_s=900)
        startup_s = time.monotonic() - started
        ours.wait(timeout=300)
        decode, prefill = topo.by_role("decode")[0], topo.by_role("prefill")[0]
        for mode in ("aggregated", "prefill-first"):  # more sidecars on the same engines
            port = free_port()
            argv = pdpool_command(
                "sidecar",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--decode-url",
                decode.url,
                "--mode",
                mode,
                "--prefill-url",
                f"127.0.0.1:{prefill.port}",
                "--engine-rejects",
                "no",
                "--prefill-timeout",
                "120",
                "--decode-retry-s",
                str(DECODE_RETRY_S),
            )
            with open(logs / f"sidecar-{mode}.log", "wb") as fh:  # the child holds its copy
                proc = subprocess.Popen(
                    argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
                )
            extra[mode] = (proc, f"http://127.0.0.1:{port}")
        for proc, url in extra.values():
            wait_healthy(url, proc, timeout=60)
        print(f"\nvLLM topology (2 vLLM engines, sidecar, gateway) healthy after {startup_s:.0f}s")
        yield {
            "topology": topo,
            "ours": ours,
            "sidecars": {m: u for m, (_, u) in extra.items()},
            "model": served_model_name(str(tiny_qwen3)),
        }
    finally:
        for proc, _ in extra.values():
            proc.terminate()
            proc.wait(10)
        topo.stop()
        ours.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def complete(url: str, model: str, prompt: str, stream: bool) -> tuple[str, str | None]:
    """Greedy text and the x-pdpool-path header (None from an engine)."""
    raw = client(url).completions.with_raw_response.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=stream,
        extra_body={"ignore_eos": True},
    )
    path = raw.headers.get("x-pdpool-path")
    out = raw.parse()
    if stream:
        return "".join(c.choices[0].text for c in out if c.choices), path
    return out.choices[0].text, path


def chat(url: str, model: str, content: str, stream: bool) -> tuple[str, str | None]:
    raw = client(url).chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=stream,
        extra_body={"ignore_eos": True},
    )
    path = raw.headers.get("x-pdpool-path")
    out = raw.parse()
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in out if c.choices), path
    return out.choices[0].message.content, path


def one_vllm(stack) -> str:
    """A single vLLM engine answering on its own (the prefill engine, asked directly)."""
    return stack["topology"].by_role("prefill")[0].url


def test_vllm_greedy_text_equals_pdpool_serve(stack):
    model = stack["model"]
    for prompt in SHORT + LONG:
        theirs, _ = complete(one_vllm(stack), model, prompt, stream=False)
        ours, _ = complete(stack["ours"].url, model, prompt, stream=False)
        assert theirs == ours, prompt
        assert len(theirs) > 0
    for content in (SHORT[0], LONG[0]):
        assert (
            chat(one_vllm(stack), model, content, False)[0]
            == chat(stack["ours"].url, model, content, False)[0]
        )


# Bodies whose acceptance vLLM decides one way: ours (engine and gateway) must agree.
STATUS_CASES = [
    ("completions", {"stream_options": {"include_usage": True}}),
    ("completions", {"stream": False, "stream_options": {"include_usage": False}}),
    ("completions", {"stream_options": {}}),
    ("completions", {"stream_options": None}),
    ("chat/completions", {"stream_options": {"continuous_usage_stats": True}}),
    ("chat/completions", {"stream": True, "stream_options": {"include_usage": True}}),
    ("completions", {"truncate_prompt_tokens": 10**7}),
    ("completions", {"truncate_prompt_tokens": -2}),
    ("completions", {"truncate_prompt_tokens": 0}),
    ("completions", {"truncate_prompt_tokens": 3, "truncation_side": "middle"}),
    ("completions", {"truncate_prompt_tokens": -1}),
    ("chat/completions", {"truncate_prompt_tokens": 5}),
    ("completions", {"max_tokens": 0}),
    ("completions", {"max_tokens": 0, "echo": True}),
    ("completions", {"echo": True}),
    ("completions", {"max_tokens": 0, "echo": True, "min_tokens": 1}),
    ("completions", {"max_tokens": 0, "echo": True, "min_tokens": 2}),
    ("completions", {"prompt_logprobs": 2}),
    ("completions", {"prompt_logprobs": 1, "stream": True}),
    ("completions", {"prompt_logprobs": 0, "stream": True}),
    ("completions", {"prompt_logprobs": -2}),
    ("completions", {"prompt_logprobs": 21}),
    ("completions", {"echo": True, "logprobs": 1}),
    ("chat/completions", {"prompt_logprobs": 1}),
    ("chat/completions", {"prompt_logprobs": 3, "stream": True}),
]


@pytest.mark.parametrize("route,fields", STATUS_CASES)
def test_a_body_is_accepted_or_refused_as_vllm_does(stack, route, fields):
    body = {"model": stack["model"], "max_tokens": 2, "temperature": 0, **fields}
    if route == "completions":
        body["prompt"] = SHORT[0]
    else:
        body["messages"] = [{"role": "user", "content": SHORT[0]}]
    want = httpx.post(f"{one_vllm(stack)}/v1/{route}", json=body, timeout=60).status_code
    for url in (stack["ours"].url, stack["topology"].gateway.url):
        got = httpx.post(f"{url}/v1/{route}", json=body, timeout=60)
        assert got.status_code == want, (url, fields, got.text[:300])


FALLBACK_RETRIES = 3
# The sidecar's ejection time of a prefill engine (2 s at first) and one of its 1 s probes.
READMIT_WAIT_S = 3.0


def taking_its_path(ask, expected: str) -> tuple[str, str | None]:
    """`ask()` through the gateway; again when the sidecar answered by decode alone
    ("fallback": what it does when a prefill attempt fails, e.g. a connect timeout while
    this 2-core machine stalls), so that a transient failure is not read as the wrong path.
    The stall that failed the attempt may also have ejected the prefill engine (its health
    probes timed out), and an ejected engine is not tried until a probe readmits it after its
    ejection time: each retry waits for that first. A path still wrong after the retries, or
    wrong otherwise, is returned as it came."""
    got, path = ask()
    for _ in range(FALLBACK_RETRIES):
        if path != "fallback" or expected != "pd":
            break
        time.sleep(READMIT_WAIT_S)
        again, path = ask()
        assert again == got  # the fallback's text was the right one too
    return got, path


@pytest.mark.parametrize("stream", [False, True])
def test_gateway_decode_first_by_length_equals_one_vllm(stack, stream):
    model, gateway = stack["model"], stack["topology"].gateway.url
    for prompt in SHORT + LONG:
        want, _ = complete(one_vllm(stack), model, prompt, stream=False)
        expected = "pd" if prompt in LONG else "decode"
        got, path = taking_its_path(partial(complete, gateway, model, prompt, stream), expected)
        assert got == want, (prompt, path)
        assert path == expected, prompt
    for content in (SHORT[1], LONG[1]):
        want, _ = chat(one_vllm(stack), model, content, stream=False)
        expected = "pd" if content in LONG else "decode"
        got, path = taking_its_path(partial(chat, gateway, model, content, stream), expected)
        assert got == want and path == expected


@pytest.mark.parametrize(
    "mode,expected_path", [("aggregated", "aggregated"), ("prefill-first", "pd")]
)
@pytest.mark.parametrize("stream", [False, True])
def test_sidecar_modes_equal_one_vllm(stack, mode, expected_path, stream):
    model, url = stack["model"], stack["sidecars"][mode]
    for prompt in (SHORT[2], LONG[2]):
        want, _ = complete(one_vllm(stack), model, prompt, stream=False)
        got, path = complete(url, model, prompt, stream=stream)
        assert got == want and path == expected_path, (mode, prompt, path)
    want, _ = chat(one_vllm(stack), model, LONG[0], stream=False)
    got, path = chat(url, model, LONG[0], stream=stream)
    assert got == want and path == expected_path


def ending(url: str, model: str, chat: bool, stream: bool, **fields) -> tuple:
    """(text, finish_reason, stop_reason) of a greedy answer, read from the raw JSON or SSE
    (every field as the server wrote it), and its streamed token ids (None unstreamed)."""
    body: dict = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    body.update(fields)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    resp = httpx.post(url + path, json=body, timeout=300)
    assert resp.status_code == 200, resp.text

    def text_of(choice: dict) -> str:
        if not chat:
            return choice.get("text") or ""
        return (choice.get("delta") or choice.get("message") or {}).get("content") or ""

    if not stream:
        choice = resp.json()["choices"][0]
        return (text_of(choice), choice["finish_reason"], choice["stop_reason"]), None
    text, ids, last = "", [], None
    for line in resp.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices") or []:
            text += text_of(choice)
            ids += choice.get("token_ids") or []
            if choice.get("finish_reason") is not None:
                last = choice
    assert last is not None, resp.text
    return (text, last["finish_reason"], last.get("stop_reason")), ids


def ascii_word_in(text: str) -> str:
    """Three ASCII letters from inside the text (after its first characters)."""
    found = re.search(r"[A-Za-z]{3}", text[3:])
    assert found, text
    return found.group(0)


@pytest.mark.parametrize("chat", [False, True])
def test_stop_strings_and_stop_tokens_end_answers_as_vllm_does(stack, chat):
    model, vllm_url = stack["model"], one_vllm(stack)
    targets = {"ours": stack["ours"].url, "gateway": stack["topology"].gateway.url}
    prompt = {"messages": [{"role": "user", "content": SHORT[0]}]} if chat else {"prompt": LONG[0]}
    (text, *_), ids = ending(
        vllm_url, model, chat, True, ignore_eos=True, return_token_ids=True, **prompt
    )
    stop_at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    cases = [
        {"stop": [ascii_word_in(text)]},
        {"stop": ["zz", ascii_word_in(text)], "include_stop_str_in_output": True},
        {"stop_token_ids": [ids[stop_at]]},
        {"stop": ["#%never%#"]},  # ends by length: no stop_reason
    ]
    for case in cases:
        for stream in (False, True):
            want, _ = ending(vllm_url, model, chat, stream, ignore_eos=True, **prompt, **case)
            assert want[1] == ("length" if "never" in str(case) else "stop"), (case, want)
            for name, url in targets.items():
                got, _ = ending(url, model, chat, stream, ignore_eos=True, **prompt, **case)
                assert got == want, (name, case, stream)


@pytest.mark.parametrize(
    "penalties",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.7},
        {"repetition_penalty": 1.3},
        {"repetition_penalty": 0.7, "frequency_penalty": -0.5, "presence_penalty": 0.3},
        {"allowed_token_ids": list(range(40, 90))},
    ],
)
def test_penalties_and_allowed_tokens_change_greedy_answers_as_in_vllm(stack, penalties):
    model, vllm_url = stack["model"], one_vllm(stack)
    prompt = {"prompt": LONG[0], "ignore_eos": True}
    plain, _ = ending(vllm_url, model, False, False, **prompt)
    want, _ = ending(vllm_url, model, False, False, **prompt, **penalties)
    assert want[0] != plain[0], "the penalties must change this answer to test anything"
    for name, url in (("ours", stack["ours"].url), ("gateway", stack["topology"].gateway.url)):
        for stream in (False, True):
            got, _ = ending(url, model, False, stream, **prompt, **penalties)
            assert got == want, (name, stream)
    chat = {"messages": [{"role": "user", "content": SHORT[1]}], "ignore_eos": True}
    want, _ = ending(vllm_url, model, True, False, **chat, **penalties)
    assert ending(stack["ours"].url, model, True, False, **chat, **penalties)[0] == want


def bannable_words(tokenizer, ids: list[int]) -> tuple[str, str]:
    """From an answer's token ids: a word that is one of them however vLLM spells it (with
    its space or not), and a word of two consecutive ones; banning either changes it."""

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    one = two = None
    for i in range(1, len(ids)):
        word = tokenizer.decode([ids[i]]).strip()
        plain, spaced = (encode(word), encode(" " + word)) if word else ([], [])
        if one is None and (plain == [ids[i]] or (spaced == [ids[i]] and len(plain) == 1)):
            one = word
        pair = tokenizer.decode(ids[i - 1 : i + 1])
        if two is None and pair == pair.lstrip() and encode(pair) == ids[i - 1 : i + 1]:
            two = pair
    assert one and two, ("no bannable word in the answer", ids)
    return one, two


@pytest.mark.parametrize("chat", [False, True])
def test_bad_words_change_greedy_answers_as_in_vllm(stack, chat, tiny_qwen3):
    """Words of vLLM's own greedy answer, banned: one token (spelt with its space and
    without), two tokens (the second banned only after the first), a repeat."""
    from transformers import AutoTokenizer

    model, vllm_url = stack["model"], one_vllm(stack)
    prompt = {"messages": [{"role": "user", "content": SHORT[1]}]} if chat else {"prompt": LONG[0]}
    (plain, *_), ids = ending(
        vllm_url, model, chat, True, ignore_eos=True, return_token_ids=True, **prompt
    )
    one, two = bannable_words(AutoTokenizer.from_pretrained(tiny_qwen3), ids)
    cases = [{"bad_words": [one]}, {"bad_words": [two]}, {"bad_words": [" " + one, two, two]}]
    for case in cases:
        want, _ = ending(vllm_url, model, chat, False, ignore_eos=True, **prompt, **case)
        assert want[0] != plain, ("the bad words must change this answer", case)
        for name, url in (("ours", stack["ours"].url), ("gateway", stack["topology"].gateway.url)):
            for stream in (False, True):
                got, _ = ending(url, model, chat, stream, ignore_eos=True, **prompt, **case)
                assert got == want, (name, case, stream)


@pytest.mark.parametrize(
    "chat,truncation",
    [
        (False, {"truncate_prompt_tokens": 12}),
        (False, {"truncate_prompt_tokens": 12, "truncation_side": "right"}),
        (False, {"truncate_prompt_tokens": 12, "truncation_side": "left"}),
        (True, {"truncate_prompt_tokens": 9}),
    ],
)
def test_truncated_prompts_answer_as_in_vllm(stack, chat, truncation):
    model, vllm_url = stack["model"], one_vllm(stack)
    prompt = {"messages": [{"role": "user", "content": LONG[1]}]} if chat else {"prompt": LONG[1]}
    fields = {**prompt, "ignore_eos": True, **truncation}
    want, _ = ending(vllm_url, model, chat, False, **fields)
    assert want != ending(vllm_url, model, chat, False, **prompt, ignore_eos=True)[0]
    kept = _prompt_tokens(vllm_url, model, chat, fields)
    assert kept == truncation["truncate_prompt_tokens"]
    for name, url in (("ours", stack["ours"].url), ("gateway", stack["topology"].gateway.url)):
        for stream in (False, True):
            got, _ = ending(url, model, chat, stream, **fields)
            assert got == want, (name, stream)
        assert _prompt_tokens(url, model, chat, fields) == kept, name


ECHO_CASES = [
    {"prompt": SHORT[0]},
    {"prompt": LONG[0]},  # P/D through the gateway
    {"prompt": SHORT[1], "max_tokens": 0},
    {"prompt": LONG[1], "max_tokens": 0},
    {"prompt": [5, 6, 7, 8]},  # token ids: echoed as they decode
]


CONTINUED = [{"role": "user", "content": SHORT[2]}, {"role": "assistant", "content": LONG[0]}]
CHAT_ECHO_CASES = [
    {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True},
    {"messages": CONTINUED},  # an assistant message last: echoed before a new one
    {"messages": [{"role": "user", "content": SHORT[0]}]},  # nothing to echo
]


@pytest.mark.parametrize(
    "chat,fields", [(False, f) for f in ECHO_CASES] + [(True, f) for f in CHAT_ECHO_CASES]
)
def test_echo_answers_as_in_vllm(stack, chat, fields):
    model, vllm_url = stack["model"], one_vllm(stack)
    fields = {**fields, "echo": True, "ignore_eos": True}
    want, _ = ending(vllm_url, model, chat, False, **fields)
    if isinstance(fields.get("prompt"), str):
        assert want[0].startswith(fields["prompt"])
    for name, url in (("ours", stack["ours"].url), ("gateway", stack["topology"].gateway.url)):
        for stream in (False, True):
            got, _ = ending(url, model, chat, stream, **fields)
            assert got == want, (name, stream)


PROMPT_LOGPROB_CASES = [
    (False, {"prompt": SHORT[0], "prompt_logprobs": 0}),
    (False, {"prompt": LONG[0], "prompt_logprobs": 3}),  # P/D length: served where it lands
    (False, {"prompt": [SHORT[1], SHORT[2]], "prompt_logprobs": 1}),  # a batch
    (False, {"prompt": SHORT[1], "echo": True, "logprobs": 2}),
    (False, {"prompt": LONG[1], "echo": True, "logprobs": 1, "max_tokens": 0}),
    (True, {"messages": [{"role": "user", "content": LONG[2]}], "prompt_logprobs": 2}),
]
# vLLM's CPU worker and ours sum in other orders (both float32 here).
PROMPT_LOGPROB_ATOL = 2e-3


@pytest.mark.parametrize("chat,fields", PROMPT_LOGPROB_CASES)
def test_prompt_logprobs_answer_as_in_vllm(stack, chat, fields):
    """The same rows (the prompt token, its rank, the likeliest with ranks 1..k, their
    texts) and logprobs within float tolerance; completions' echo with logprobs the same
    tokens, texts and offsets, the prompt's first token with none."""
    model, path = stack["model"], "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": model, "max_tokens": 3, "temperature": 0, "ignore_eos": True, **fields}
    want = httpx.post(one_vllm(stack) + path, json=body, timeout=300)
    assert want.status_code == 200, want.text
    for name, url in (("ours", stack["ours"].url), ("gateway", stack["topology"].gateway.url)):
        got = httpx.post(url + path, json=body, timeout=300)
        assert got.status_code == 200, (name, got.text)
        _same_prompt_logprobs(want.json(), got.json(), chat, name)


def _same_prompt_logprobs(want: dict, got: dict, chat: bool, name: str) -> None:
    holders = [(want, got)] if chat else list(zip(want["choices"], got["choices"], strict=True))
    for w, g in holders:
        if w.get("prompt_logprobs") is None:
            assert g.get("prompt_logprobs") is None, name
        else:
            assert len(g["prompt_logprobs"]) == len(w["prompt_logprobs"]), name
            assert g["prompt_logprobs"][0] is None is w["prompt_logprobs"][0]
            for rw, rg in zip(w["prompt_logprobs"][1:], g["prompt_logprobs"][1:], strict=True):
                assert rw.keys() == rg.keys(), name
                for token, entry in rw.items():
                    mine = rg[token]
                    assert mine["rank"] == entry["rank"], (name, token)
                    assert mine["decoded_token"] == entry["decoded_token"], (name, token)
                    assert abs(mine["logprob"] - entry["logprob"]) < PROMPT_LOGPROB_ATOL, name
    if chat:
        content = [a["choices"][0]["message"]["content"] for a in (want, got)]
        assert content[1] == content[0], name
        return
    for w, g in zip(want["choices"], got["choices"], strict=True):
        assert g["text"] == w["text"], name
        lw, lg = w["logprobs"], g["logprobs"]
        if lw is None:
            assert lg is None, name
            continue
        assert lg["tokens"] == lw["tokens"] and lg["text_offset"] == lw["text_offset"], name
        for a, b in zip(lw["token_logprobs"], lg["token_logprobs"], strict=True):
            assert (a is None) == (b is None), name
            assert a is None or abs(a - b) < PROMPT_LOGPROB_ATOL, name
        for a, b in zip(lw["top_logprobs"], lg["top_logprobs"], strict=True):
            assert (a is None) == (b is None), name
            assert a is None or a.keys() == b.keys(), name


def _prompt_tokens(url: str, model: str, chat: bool, fields: dict) -> int:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": model, "max_tokens": 1, "temperature": 0, **fields}
    r = httpx.post(url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_pd_moved_kv_through_nixl(stack):
    decode = stack["topology"].by_role("decode")[0]
    before = _external_tokens(decode.url)
    prompt = "A fresh prompt that nobody has sent before, long enough for P/D: " + "z" * 40
    _, path = complete(stack["topology"].gateway.url, stack["model"], prompt, stream=False)
    assert path == "pd"
    assert _external_tokens(decode.url) > before


def _external_tokens(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    fams = check_vllm_names(text)
    return sum(
        s.value
        for s in fams["vllm:prompt_tokens_by_source"].samples
        if s.labels.get("source") == "external_kv_transfer" and s.name.endswith("_total")
    )


def test_vllm_metric_names_are_what_our_engine_copies(stack):
    model = stack["model"]
    complete(one_vllm(stack), model, SHORT[0], stream=False)
    check_vllm_names(httpx.get(one_vllm(stack) + "/metrics", timeout=10).text)
    check_vllm_names(httpx.get(stack["ours"].url + "/metrics", timeout=10).text)


def test_vllm_engines_join_the_trace(stack, receiver):
    trace_id = secrets.token_hex(16)
    prompt = "A traced prompt that nobody has sent before, long enough for P/D: " + "q" * 40
    body = {"model": stack["model"], "prompt": prompt, "max_tokens": 4, "temperature": 0}
    r = httpx.post(
        stack["topology"].gateway.url + "/v1/completions",
        json=body,
        headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"},
        timeout=300,
    )
    assert r.status_code == 200 and r.headers["x-pdpool-path"] == "pd"

    def mine(spans):
        return [s for s in spans if s["trace_id"] == trace_id]

    def complete(spans):  # vLLM's spans and their parents (other processes export apart)
        ids = {s["span_id"] for s in mine(spans)}
        engines = [s for s in mine(spans) if s["name"] == "llm_request"]
        return len(engines) >= 2 and all(s["parent_span_id"] in ids for s in engines)

    spans = mine(receiver.wait_for(complete, timeout_s=60))
    by_id = {s["span_id"]: s for s in spans}
    parents = {by_id[s["parent_span_id"]]["name"] for s in spans if s["name"] == "llm_request"}
    assert parents == {"prefill_attempt", "decode"}  # vLLM's spans, under our legs
    for s in spans:
        if s["name"] == "llm_request":
            assert s["attributes"]["gen_ai.usage.prompt_tokens"] > 16
