"""Random valid greedy requests sent to two servers of one model, their answers compared:
the text (token ids for token-id prompts), finish and stop reasons, usage and logprobs of
every choice, whole and streamed. Against vLLM it finds where our reading of a field
differs; between two topologies of ours (P/D through `pdpool up --mode prefill-first`
against one `pdpool serve`) it finds what the KV handoff changes.

    python -m devtools.answer_diff http://127.0.0.1:8000 http://127.0.0.1:8100 --requests 200

A request mixes the fields that change an answer: stop strings and stop token ids,
include_stop_str_in_output, min_tokens, ignore_eos, logit_bias, allowed_token_ids, the
three penalties, n, truncate_prompt_tokens, skip_special_tokens, logprobs, echo, chat
flags (add_generation_prompt, continue_final_message), batches of prompts and token-id
prompts.
All at temperature 0, so both servers owe the same tokens (up to float rounding at ties).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import urlsplit

WORDS = "the a of to and in is it river stone cloud hello world question answer token".split()
VOCAB = 512  # the tiny checkpoints'


class RequestMaker:
    """`prefix_words` > 0: every text prompt and first message starts with one shared
    prefix of that many words and goes on for up to as many more, so that an engine holds
    part of each prompt already (prefix caching; in P/D, a prefill that pulls the decode
    engine's cached prefix)."""

    def __init__(self, model: str, seed: int, vocab: int = VOCAB, prefix_words: int = 0):
        self.model, self.vocab = model, vocab
        self.rnd = random.Random(seed)
        # echo is drawn apart, so that a seed's other choices are what they were before it
        self.echo_rnd = random.Random(seed + 1)
        self.prefix = self.text(prefix_words) + " " if prefix_words else ""
        self.scale = max(prefix_words, 1)

    def text(self, words: int) -> str:
        return " ".join(self.rnd.choice(WORDS) for _ in range(words))

    def prompt_text(self, low: int, high: int) -> str:
        if not self.prefix:
            return self.text(self.rnd.randint(low, high))
        return self.prefix + self.text(self.rnd.randint(low, high) * self.scale // 4)

    def ids(self, low: int, high: int) -> list[int]:
        return [self.rnd.randrange(3, self.vocab) for _ in range(self.rnd.randint(low, high))]

    def options(self) -> list[tuple[str, Callable[[], Any]]]:
        r = self.rnd
        return [
            ("stop", lambda: r.choice([[r.choice(WORDS)], r.choice(WORDS), [" ", "e"]])),
            ("include_stop_str_in_output", lambda: True),
            ("min_tokens", lambda: r.choice([0, 2, 5])),
            ("ignore_eos", lambda: True),
            ("stop_token_ids", lambda: self.ids(1, 5)),
            ("logit_bias", lambda: {str(r.randrange(self.vocab)): r.choice([-100, 5, 100])}),
            ("allowed_token_ids", lambda: self.ids(1, 20)),
            ("repetition_penalty", lambda: r.choice([1.2, 0.8, 2.0])),
            ("presence_penalty", lambda: r.choice([1.0, -1.0, 2.0])),
            ("frequency_penalty", lambda: r.choice([0.5, -0.5, 2.0])),
            ("truncate_prompt_tokens", lambda: r.choice([1, 3, 5])),
            ("skip_special_tokens", lambda: False),
            ("n", lambda: r.choice([2, 3])),
        ]

    def request(self, with_n: bool) -> tuple[str, dict[str, Any]]:
        r = self.rnd
        body: dict[str, Any] = {"model": self.model, "temperature": 0, "return_token_ids": True}
        body["max_tokens"] = r.choice([1, 5, 12, 20])
        if r.random() < 0.5:
            path = "/v1/chat/completions"
            messages = [{"role": "user", "content": self.prompt_text(1, 8)}]
            if r.random() < 0.3:
                messages.insert(0, {"role": "system", "content": self.text(4)})
            if r.random() < 0.2:
                messages.append({"role": "assistant", "content": self.text(2)})
                body.update(continue_final_message=True, add_generation_prompt=False)
            body["messages"] = messages
            if r.random() < 0.3:
                body.update(logprobs=True, top_logprobs=r.choice([0, 1, 3]))
        else:
            path = "/v1/completions"
            kind = r.random()
            body["prompt"] = (
                self.prompt_text(1, 10)
                if kind < 0.6
                else self.ids(1, 12)
                if kind < 0.8
                else [self.text(3), self.text(2)]
            )
            if r.random() < 0.3:
                body["logprobs"] = r.choice([0, 1, 3])
        options = [o for o in self.options() if with_n or o[0] != "n"]
        for name, value in r.sample(options, r.randint(0, 4)):
            body[name] = value()
        body["min_tokens"] = min(body.get("min_tokens", 0), body["max_tokens"])
        if "logprobs" not in body and self.echo_rnd.random() < 0.2:
            # (with logprobs the prompt is scored where the request lands, off the P/D path)
            body["echo"] = True
            if not _by_ids(body):  # compared by text, which echoes only without the ids
                body["return_token_ids"] = False
        return path, body


def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _choice_logprobs(choice: dict[str, Any], chat: bool) -> Any:
    lps = choice.get("logprobs")
    if not lps:
        return None
    if chat:
        return [(c["token"], [t["token"] for t in c["top_logprobs"]]) for c in lps["content"]]
    tops = lps["top_logprobs"] or [None] * len(lps["tokens"])
    return [(t, sorted(top or {})) for t, top in zip(lps["tokens"], tops, strict=True)]


def _by_ids(body: dict[str, Any]) -> bool:
    """A token-id prompt: compared by token ids (vLLM starts its text from the prompt's
    bytes)."""
    return isinstance(body.get("prompt"), list) and not isinstance(body["prompt"][0], str)


def whole_answer(status: int, raw: bytes, body: dict[str, Any]) -> Any:
    """What must be equal in a whole answer: per choice its output (token ids for a token-id
    prompt, whose text vLLM starts from the prompt's bytes), reasons and logprobs' tokens."""
    if status != 200:
        return ("status", status)
    answer = json.loads(raw)
    chat = "messages" in body
    by_ids = _by_ids(body)
    choices = []
    for c in sorted(answer["choices"], key=lambda c: c["index"]):
        out = c.get("token_ids") if by_ids else (c["message"]["content"] if chat else c["text"])
        choices.append((out, c["finish_reason"], c.get("stop_reason"), _choice_logprobs(c, chat)))
    usage = answer["usage"]
    return choices, usage["prompt_tokens"], usage["completion_tokens"]


def streamed_answer(status: int, raw: bytes, body: dict[str, Any]) -> Any:
    if status != 200:
        return ("status", status)
    chat = "messages" in body
    by_ids = _by_ids(body)
    outs: dict[int, Any] = {}
    ends: dict[int, Any] = {}
    for line in raw.decode().splitlines():
        if not line.startswith("data: {"):
            continue
        for c in json.loads(line[6:]).get("choices", []):
            i = c["index"]
            if by_ids:
                outs[i] = outs.get(i, []) + (c.get("token_ids") or [])
            else:
                piece = (c["delta"].get("content") or "") if chat else c.get("text", "")
                outs[i] = outs.get(i, "") + piece
            if c.get("finish_reason"):
                ends[i] = (c["finish_reason"], c.get("stop_reason"))
    return sorted((i, outs[i], ends.get(i)) for i in outs)


@dataclass
class Report:
    same: int = 0
    differ: list[dict[str, Any]] = field(default_factory=list)


def compare(
    url: str,
    other: str,
    requests: int,
    seed: int,
    stream: bool,
    with_n: bool = True,
    prefix_words: int = 0,
) -> Report:
    model = json.loads(_get(url, "/v1/models"))["data"][0]["id"]
    maker, report = RequestMaker(model, seed, prefix_words=prefix_words), Report()
    read = streamed_answer if stream else whole_answer
    for _ in range(requests):
        path, body = maker.request(with_n)
        if stream:
            body = {**body, "stream": True}
        a, b = (read(*post(u, path, body), body) for u in (url, other))
        if a == b:
            report.same += 1
        else:
            report.differ.append({"body": body, "first": a, "second": b})
    return report


def _get(url: str, path: str) -> bytes:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=60)
    try:
        conn.request("GET", path)
        return conn.getresponse().read()
    finally:
        conn.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("other")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stream", action="store_true", help="compare streamed answers")
    ap.add_argument(
        "--no-n", action="store_true", help="n stays 1 (vLLM refuses n > 1 at temperature 0)"
    )
    ap.add_argument(
        "--prefix-words",
        type=int,
        default=0,
        help="a prefix of this many words shared by every prompt (prefix caching, pulls)",
    )
    args = ap.parse_args()
    report = compare(
        args.url,
        args.other,
        args.requests,
        args.seed,
        args.stream,
        not args.no_n,
        args.prefix_words,
    )
    print(json.dumps({"same": report.same, "differ": report.differ[:20]}, indent=1, default=str))
    return 1 if report.differ else 0


if __name__ == "__main__":
    sys.exit(main())
