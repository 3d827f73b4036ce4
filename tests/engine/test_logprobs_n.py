"""logprobs / top_logprobs against transformers, and n > 1 / prompt batches against single
requests, on a real `pdpool serve` process."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from devtools.engine_procs import spawned_engine
from tests.support.logprobs import LOGPROB_ATOL as ATOL
from tests.support.logprobs import assert_logprobs_close

# Starts engine processes: the full run's tier, not the fast one.
pytestmark = pytest.mark.slow

# ATOL: the engine and transformers, both float32, differ by summation order only (the
# tolerance's reasons are with LOGPROB_ATOL).


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    with spawned_engine(
        tiny_qwen3, tmp_path_factory.mktemp("logs"), "--num-kv-blocks", "128"
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def hf(tiny_qwen3):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_qwen3))


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream(
        "POST", f"{server.url}/v1/{path}", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def tid(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.split(":", 1)[1])


def ref_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each output position: `[len(output), vocab]`."""
    model, _ = hf
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    n = len(prompt)
    return torch.log_softmax(logits[n - 1 : n - 1 + len(output)], dim=-1)


def check_token(
    ref_row: torch.Tensor, token: int, logprob: float, top: list[tuple[int, float]], k: int
) -> None:
    assert abs(logprob - ref_row[token].item()) < ATOL
    # The k most likely, best first, with transformers' values.
    values = [v for _, v in top]
    assert len(top) == k and values == sorted(values, reverse=True)
    ref_top = ref_row.topk(k).values.tolist()
    for (i, v), r in zip(top, ref_top, strict=True):
        assert abs(v - ref_row[i].item()) < ATOL and abs(v - r) < ATOL


PROMPT_IDS = [17, 250, 33, 480, 12, 99, 305, 7, 64, 211, 150, 42]


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, seed=3)])
def test_completion_logprobs_match_transformers(server, hf, sampling):
    k = 5
    body = dict(
        prompt=PROMPT_IDS,
        max_tokens=8,
        ignore_eos=True,
        logprobs=k,
        return_tokens_as_token_ids=True,
        **sampling,
    )
    full = post(server, "completions", body)["choices"][0]["logprobs"]
    chunks = stream(server, "completions", body)
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    streamed = {key: [x for p in parts if p for x in p[key]] for key in full}
    assert streamed["tokens"] == full["tokens"]
    output = [tid(t) for t in full["tokens"]]
    assert len(output) == 8
    for lps in (full, streamed):
        ref = ref_logprobs(hf, PROMPT_IDS, output)
        for j, token in enumerate(output):
            top = list(lps["top_logprobs"][j].items())
            # vLLM's shape: the k most likely plus the sampled token when not among them.
            in_top = lps["tokens"][j] in dict(top[:k])
            assert len(top) == (k if in_top else k + 1)
            check_token(
                ref[j], token, lps["token_logprobs"][j], [(tid(t), v) for t, v in top[:k]], k
            )
            if not in_top:
                # Exact: both are the same float of one response (the sampled token's
                # logprob, listed twice), not two computations.
                assert top[k] == (lps["tokens"][j], lps["token_logprobs"][j])
        offsets = lps["text_offset"]
        assert offsets[0] == 0 and all(
            offsets[j + 1] == offsets[j] + len(lps["tokens"][j]) for j in range(len(offsets) - 1)
        )
    if sampling["temperature"] == 0:  # greedy picks the top token
        assert all(
            lps_top[0] == t
            for lps_top, t in zip(
                (list(d) for d in full["top_logprobs"]), full["tokens"], strict=True
            )
        )


def test_chat_logprobs_match_transformers(server, hf):
    _, tok = hf
    msgs = [{"role": "user", "content": "Tell me about the river"}]
    prompt = tok(
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    k = 3
    body = dict(
        messages=msgs,
        max_tokens=8,
        temperature=0,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=k,
        return_tokens_as_token_ids=True,
    )
    full = post(server, "chat/completions", body)["choices"][0]["logprobs"]["content"]
    chunks = stream(server, "chat/completions", body)
    streamed = [
        c
        for ch in chunks
        for choice in ch["choices"]
        if choice["logprobs"]
        for c in choice["logprobs"]["content"]
    ]
    assert [c["token"] for c in streamed] == [c["token"] for c in full]
    output = [tid(c["token"]) for c in full]
    ref = ref_logprobs(hf, prompt, output)
    for content in (full, streamed):
        for j, c in enumerate(content):
            assert c["bytes"] == list(c["token"].encode())
            assert all(t["bytes"] == list(t["token"].encode()) for t in c["top_logprobs"])
            check_token(
                ref[j],
                tid(c["token"]),
                c["logprob"],
                [(tid(t["token"]), t["logprob"]) for t in c["top_logprobs"]],
                k,
            )
    # Token text by default; logprobs without top_logprobs: the sampled token only.
    plain = post(
        server,
        "chat/completions",
        {**body, "return_tokens_as_token_ids": False, "top_logprobs": None},
    )
    content = plain["choices"][0]["logprobs"]["content"]
    # Greedy: the same tokens, exactly. Their logprobs come from another computation (this
    # request hits the prefix cache and prefills fewer tokens, in other shapes), so they are
    # equal only up to float32 rounding.
    # A token shows its own text; a byte piece of a split character shows "" until the piece
    # that completes it, which shows the character (no lone U+FFFD).
    for c, ref_c in zip(content, full, strict=True):
        alone = tok.decode([tid(ref_c["token"])])
        assert c["token"] == alone or (alone.endswith("\ufffd") and "\ufffd" not in c["token"])
    assert_logprobs_close([c["logprob"] for c in content], [c["logprob"] for c in full])
    assert all(
        c["top_logprobs"] == [] and c["bytes"] == list(c["token"].encode("utf-8")) for c in content
    )
    # (The text may hold back an incomplete UTF-8 sequence at the end; the tokens do not.
    # Special tokens are in the logprobs but skipped in the text. Bytes that never make a
    # character are U+FFFD in the text and "" in the tokens.)
    tokens_text = re.sub(r"<\|[a-z_]+\|>", "", "".join(c["token"] for c in content))
    assert tokens_text.startswith(plain["choices"][0]["message"]["content"].replace("\ufffd", ""))


@pytest.mark.parametrize(
    "path,body,needle",
    [
        ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        ("completions", {"prompt": "hi", "n": 17}, "n"),
        (
            "completions",
            {"prompt": ["a", "b"], "kv_transfer_params": {"do_remote_decode": True}},
            "kv_transfer_params",
        ),
    ],
)
def test_bad_logprobs_and_n_are_400(server, path, body, needle):
    r = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_top_logprobs_zero_without_logprobs_asks_for_nothing(server):
    # as vLLM: only a positive top_logprobs needs logprobs set (clients send 0 by default)
    body = {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 0, "max_tokens": 2}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None


def _texts(resp: dict) -> list[str]:
    choices = sorted(resp["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(len(choices)))
    return [c["text"] for c in choices]


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=11)])
def test_n_and_prompt_batches_equal_single_requests(server, sampling):
    base = dict(max_tokens=10, ignore_eos=True, **sampling)
    prompts = ["The river bank was", "Tokens flow through", "In the beginning"]

    def single(prompt, i: int = 0) -> dict:
        seed = {"seed": sampling["seed"] + i} if "seed" in sampling else {}
        return post(server, "completions", {**base, **seed, "prompt": prompt})

    # n = 3: choice i samples with seed + i (vLLM's derivation).
    many = post(server, "completions", {**base, "prompt": prompts[0], "n": 3})
    singles = [single(prompts[0], i) for i in range(3)]
    assert _texts(many) == [s["choices"][0]["text"] for s in singles]
    if "seed" in sampling:
        assert len(set(_texts(many))) > 1, "seeded choices should differ"
    assert many["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    assert many["usage"]["completion_tokens"] == 30
    # A batch of token-id prompts.
    ids = [[17, 250, 33, 480], [5, 6, 7], [300, 2, 450, 61, 9]]
    assert _texts(post(server, "completions", {**base, "prompt": ids})) == [
        single(p)["choices"][0]["text"] for p in ids
    ]
    # A batch of 3 prompts x n = 2: index = prompt * n + i.
    batch = post(server, "completions", {**base, "prompt": prompts, "n": 2})
    expected = [single(p, i) for p in prompts for i in range(2)]
    assert _texts(batch) == [e["choices"][0]["text"] for e in expected]
    assert batch["usage"]["prompt_tokens"] == sum(
        e["usage"]["prompt_tokens"] for e in expected[::2]
    )
    assert batch["usage"]["completion_tokens"] == 60
    # Streaming: chunks carry their choice's index; each choice ends once; usage summed.
    chunks = stream(
        server,
        "completions",
        {**base, "prompt": prompts, "n": 2, "stream_options": {"include_usage": True}},
    )
    texts, reasons = [""] * 6, [None] * 6
    for ch in chunks:
        for c in ch["choices"]:
            texts[c["index"]] += c["text"]
            if c["finish_reason"]:
                assert reasons[c["index"]] is None
                reasons[c["index"]] = c["finish_reason"]
    assert texts == _texts(batch) and reasons == ["length"] * 6
    assert chunks[-1]["usage"] == batch["usage"]


def test_chat_n_equals_single_requests(server):
    base = dict(
        messages=[{"role": "user", "content": "Name a river"}],
        max_tokens=8,
        ignore_eos=True,
        temperature=1.0,
        seed=5,
    )
    many = post(server, "chat/completions", {**base, "n": 2})
    got = [c["message"]["content"] for c in sorted(many["choices"], key=lambda c: c["index"])]
    want = [
        post(server, "chat/completions", {**base, "seed": 5 + i})["choices"][0]["message"][
            "content"
        ]
        for i in range(2)
    ]
    assert got == want and many["usage"]["completion_tokens"] == 16
    chunks = stream(server, "chat/completions", {**base, "n": 2})
    texts = ["", ""]
    for ch in chunks:
        for c in ch["choices"]:
            texts[c["index"]] += c["delta"].get("content") or ""
    assert texts == got
