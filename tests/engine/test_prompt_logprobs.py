"""vLLM's `prompt_logprobs` and completions' `echo` with `logprobs` on a real `pdpool serve`
process, against transformers' log-softmax on the same checkpoint (the same answers beside
stock vLLM: tests/vllm/test_vllm_engine.py)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from devtools.engine_procs import spawned_engine
from tests.support.logprobs import LOGPROB_ATOL as ATOL

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 300, 42, 42, 9, 128, 77, 3, 250, 11, 64, 64, 2, 199, 480, 21, 8]


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    # A small step budget: a prompt's rows are scored over several steps.
    with spawned_engine(
        tiny_qwen3,
        tmp_path_factory.mktemp("logs"),
        "--num-kv-blocks",
        "256",
        "--max-num-batched-tokens",
        "64",
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(tiny_qwen3):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32).eval()

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return log_softmax


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=120)


def ok(server, path: str, body: dict) -> dict:
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def check_rows(rows: list, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """vLLM's layout: None, then {id: {logprob, rank, decoded_token}} with the prompt
    token first and the k likeliest (ranks 1..k)."""
    assert rows[0] is None and len(rows) == len(prompt)
    for pos in range(1, len(prompt)):
        row, want = rows[pos], ref[pos - 1]
        token = prompt[pos]
        entry = row[str(token)]
        assert abs(entry["logprob"] - want[token].item()) < ATOL
        # 1 + the likelier tokens (ties within the tolerance either way)
        likelier = int((want > want[token] + ATOL).sum())
        assert likelier + 1 <= entry["rank"] <= int((want >= want[token] - ATOL).sum())
        top = want.topk(k)
        for rank, (value, tid) in enumerate(zip(top.values, top.indices, strict=True), start=1):
            got = row[str(int(tid))]
            assert abs(got["logprob"] - value.item()) < ATOL
            if int(tid) != token:
                assert got["rank"] == rank
        assert set(row) == {str(token)} | {str(int(t)) for t in top.indices}


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_match_transformers_over_several_steps(server, reference, k):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": k}
    # Twice: the second finds the prompt in the prefix cache and still scores every row.
    for _ in range(2):
        answer = ok(server, "completions", body)
        choice = answer["choices"][0]
        check_rows(choice["prompt_logprobs"], PROMPT, reference(PROMPT), k)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_long_prompt_is_scored_across_chunks(server, reference):
    prompt = [(i * 37 + 11) % 500 for i in range(300)]  # 300 rows over 64-token steps
    answer = ok(
        server,
        "completions",
        {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1, "temperature": 0},
    )
    check_rows(answer["choices"][0]["prompt_logprobs"], prompt, reference(prompt), 1)


def test_n_choices_and_prompt_batches_each_carry_their_prompt(server, reference):
    other = PROMPT[::-1]
    answer = ok(
        server,
        "completions",
        {"prompt": [PROMPT, other], "n": 2, "max_tokens": 2, "prompt_logprobs": 2, "seed": 1},
    )
    choices = answer["choices"]
    assert len(choices) == 4
    for c in choices:
        prompt = PROMPT if c["index"] < 2 else other
        check_rows(c["prompt_logprobs"], prompt, reference(prompt), 2)


def test_chat_puts_them_at_the_top(server):
    body = {
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 3,
        "prompt_logprobs": 1,
        "return_token_ids": True,
    }
    answer = ok(server, "chat/completions", body)
    rows = answer["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(answer["prompt_token_ids"])
    assert all(str(t) in r for t, r in zip(answer["prompt_token_ids"][1:], rows[1:], strict=True))
    assert "prompt_logprobs" not in answer["choices"][0]


def test_echo_with_logprobs_scores_the_prompt_then_the_answer(server, reference):
    body = {"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0}
    choice = ok(server, "completions", body)["choices"][0]
    lp = choice["logprobs"]
    n = len(PROMPT)
    assert len(lp["tokens"]) == n + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = reference(PROMPT)
    for pos in range(1, n):
        assert abs(lp["token_logprobs"][pos] - ref[pos - 1][PROMPT[pos]].item()) < ATOL
        assert 2 <= len(lp["top_logprobs"][pos]) <= 3
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert all(offsets[i + 1] - offsets[i] == len(lp["tokens"][i]) for i in range(len(offsets) - 1))
    assert choice["text"].startswith(lp["tokens"][0])
    # The answer's part is what the same request without echo reports.
    plain = ok(server, "completions", {**body, "echo": False})["choices"][0]["logprobs"]
    # (computed in other batches: equal to the summation order)
    assert lp["token_logprobs"][n:] == pytest.approx(plain["token_logprobs"], abs=ATOL)
    assert lp["tokens"][n:] == plain["tokens"]

    prompt_only = ok(server, "completions", {**body, "max_tokens": 0})["choices"][0]
    assert prompt_only["logprobs"]["tokens"] == lp["tokens"][:n]
    assert prompt_only["logprobs"]["token_logprobs"] == lp["token_logprobs"][:n]


def test_echo_with_logprobs_streams_the_prompt_in_the_first_chunk(server):
    body = {"prompt": PROMPT, "max_tokens": 4, "echo": True, "logprobs": 1, "temperature": 0}
    whole = ok(server, "completions", body)["choices"][0]
    tokens, logprobs, texts = [], [], []
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                texts.append(choice["text"])
                if choice["logprobs"]:
                    tokens += choice["logprobs"]["tokens"]
                    logprobs += choice["logprobs"]["token_logprobs"]
    assert "".join(texts) == whole["text"]
    assert tokens == whole["logprobs"]["tokens"]
    assert logprobs == whole["logprobs"]["token_logprobs"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, None),  # all: over the engine's logprob limit
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, None),
        ({"prompt_logprobs": "3"}, "prompt_logprobs"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
        (
            {
                "prompt_logprobs": 0,
                "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "x"},
            },
            "prompt_logprobs",
        ),
    ],
)
def test_malformed_or_unservable_prompt_logprobs_are_a_400(server, body, param):
    r = post(server, "completions", {"prompt": PROMPT, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "prompt_logprobs" in error["message"] or error["param"] == "prompt_logprobs"
    if param is not None:
        assert error["param"] == param


def test_a_stream_with_prompt_logprobs_0_is_served(server):
    r = post(
        server,
        "completions",
        {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 0, "stream": True},
    )
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


def test_an_answer_whose_prompt_logprobs_would_be_huge_is_refused_before_it_runs(server):
    """Each choice repeats its prompt's logprobs (echo twice): a long prompt times many
    choices and likeliest tokens is bounded, as an echo is."""
    prompt = [(i * 7 + 1) % 500 for i in range(2000)]
    body = {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 20, "n": 8}
    r = post(server, "completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    r = post(server, "completions", {**body, "prompt_logprobs": None, "echo": True, "logprobs": 20})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    # the same prompt with one choice and one likeliest token is answered
    small = {**body, "n": 1, "prompt_logprobs": 1}
    assert len(ok(server, "completions", small)["choices"][0]["prompt_logprobs"]) == 2000


def test_a_loglikelihood_request_as_lm_eval_sends_it(server, reference):
    """lm-evaluation-harness scores a context + continuation with a batch of token-id
    prompts, echo, logprobs 1 and max_tokens 1, then sums each choice's token logprobs past
    the context and checks each continuation token is the likeliest of its top_logprobs."""
    contexts = [PROMPT[:10], PROMPT[5:]]
    answer = ok(
        server,
        "completions",
        {"prompt": contexts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0},
    )
    for choice, ids in zip(answer["choices"], contexts, strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1
        ref = reference(ids)
        want = sum(ref[i - 1][ids[i]].item() for i in range(1, len(ids)))
        assert abs(sum(lp["token_logprobs"][1 : len(ids)]) - want) < ATOL * len(ids)
        for pos in range(1, len(ids)):
            top = lp["top_logprobs"][pos]
            greedy = ref[pos - 1].argmax().item() == ids[pos]
            assert (max(top, key=top.get) == lp["tokens"][pos]) == greedy
