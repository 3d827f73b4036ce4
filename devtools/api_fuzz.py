"""Random hostile requests against an OpenAI-compatible server (an engine, a sidecar or the
gateway), judged by what a client is owed: a 2xx or a 4xx with a message, never a 5xx, a
dropped connection or an answer that takes too long; a 200 that is JSON, a stream that ends
with [DONE].

Two kinds of request, drawn at random:
- a JSON body, valid at first, with fields of vLLM's request schema set to hostile values
  (wrong types, huge and negative numbers, lone surrogates, nested containers, malformed
  messages, tools and response formats);
- raw bytes: JSON literals Python's parser takes and a client should not send (NaN,
  1e999, duplicate keys), truncated bodies, a BOM, deep nesting, invalid UTF-8, large
  prompts, chunked transfer coding and other content types.

    python -m devtools.api_fuzz http://127.0.0.1:8000 --requests 2000 --seed 1
    python -m devtools.api_fuzz http://127.0.0.1:8000 --against http://127.0.0.1:8100
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import urlsplit

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
ROUTES = (
    *GENERATION_ROUTES,
    "/tokenize",
    "/detokenize",
    "/v1/completions/render",
    "/v1/chat/completions/render",
)
OTHER_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/models", "/v1/embeddings")
FIELDS = (
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "n", "best_of", "stream", "stream_options", "stop",
    "stop_token_ids", "logprobs", "top_logprobs", "echo", "suffix", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "user",
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "ignore_eos",
    "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "priority",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
    "chat_template_kwargs", "truncate_prompt_tokens", "prompt_logprobs", "kv_transfer_params",
    "cache_salt", "return_tokens_as_token_ids", "allowed_token_ids", "bad_words",
    "request_id", "vllm_xargs", "tokens", "lora_name", "lora_path",
)  # fmt: skip
HOSTILE: tuple[Any, ...] = (
    None, True, False, 0, 1, -1, 2, 1.5, -0.5, 0.0, 100, 4096, 5000, -100,
    1e308, -1e308, 2**31, 2**63, -(2**63), 2**64, 10**30,
    "", "a", "x" * 5000, "\u0000", "\ud800", "é", "1", "null", "[DONE]",
    [], [1], [[1]], [None], ["a", 1], [-1], [10**9], [""], {}, {"a": 1},
    [{"type": "text", "text": "hi"}], {"type": "json_object"}, {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": 1}},
    {"type": "text"}, {"type": "bogus"},
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    {"type": "function", "function": {"name": "g"}}, "required", "auto", "none",
)  # fmt: skip
# JSON a strict client never sends but Python's parser reads.
LITERALS = (
    "NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-999", "-0",
    "123456789012345678901234567890", '"\\ud800"', '"\\udfff\\ud800"', '"\\u0000"',
    "null", "true", "[]", "{}", '"x"', "-1", "1.0", "4.5",
)  # fmt: skip
CONTENT_TYPES = ("application/json",) * 8 + ("text/plain", "application/x-www-form-urlencoded")
# Headers a client may send, ours and the routing ones an EPP or the gateway set, with values
# of every kind a header can carry (latin-1 octets, empty, long, lists of endpoints).
HEADER_NAMES = (
    "authorization",
    "x-api-key",
    "x-request-id",
    "x-pdpool-priority",
    "x-pdpool-backend",
    "x-gateway-inference-objective",
    "x-prefiller-host-port",
    "x-gateway-destination-endpoint",
    "x-pdpool-kv-path",
    "traceparent",
    "accept-encoding",
    "expect",
)
HEADER_VALUES = (
    "1", "-1", "9999999999999999999999", "abc", "", "\t", "é", "\xff\xfe", "caf\xe9 au lait",
    "Bearer " + "k" * 20, "Bearer é", "127.0.0.1:1", "10.0.0.1:8000,127.0.0.1:22", "pd",
    "x" * 3000, "00-00000000000000000000000000000000-0000000000000000-00", "gzip, br",
    "100-continue",
)  # fmt: skip
TIMEOUT_S = 60.0


@dataclass
class Tally:
    statuses: dict[str, int] = field(default_factory=dict)
    problems: list[dict[str, Any]] = field(default_factory=list)
    slowest_s: float = 0.0

    def count(self, status: Any) -> None:
        self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1


class BodyMaker:
    """Random request bodies for one model name; every draw from one seeded generator.
    With `api_key`, most requests present it (a front door that asks for one)."""

    def __init__(self, model: str, seed: int, api_key: Optional[str] = None):
        self.model, self.api_key = model, api_key
        self.rnd = random.Random(seed)

    def hostile(self) -> Any:
        value = self.rnd.choice(HOSTILE)
        if self.rnd.random() < 0.1:
            value = {str(self.rnd.choice(HOSTILE)): value}
        if self.rnd.random() < 0.1:
            value = [value, self.rnd.choice(HOSTILE)]
        return value

    def message(self) -> Any:
        r = self.rnd.random()
        if r < 0.5:
            role = self.rnd.choice(["user", "system", "assistant", "tool", "developer", "x", None])
            content = self.rnd.choice(
                ["hi", None, "", [{"type": "text", "text": "a"}], [{"type": "text"}], 5, {"x": 1},
                 [{"type": "image_url", "image_url": {"url": "x"}}]]
            )  # fmt: skip
            return {"role": role, "content": content}
        if r < 0.7:
            arguments = self.rnd.choice(["{}", "{", 5, None, '{"a": 1}'])
            call = {
                "id": "c",
                "type": "function",
                "function": {"name": "f", "arguments": arguments},
            }
            return {"role": "assistant", "tool_calls": [call], "content": None}
        if r < 0.8:
            return {"role": "tool", "tool_call_id": self.rnd.choice(["c", None, 5]), "content": "r"}
        return self.hostile()

    def json_body(self, route: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.rnd.choice([1, 4, 8])}
        if route.startswith("/v1/completions"):
            body["prompt"] = self.rnd.choice(["hello", [1, 2, 3], ["a", "b"], [[1, 2], [3]]])
        elif route.startswith("/v1/chat"):
            body["messages"] = [{"role": "user", "content": "hello"}]
        elif route == "/tokenize":
            body = {"model": self.model, "prompt": "hi"}
            if self.rnd.random() < 0.5:
                body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}]}
        elif route == "/detokenize":
            body = {"model": self.model, "tokens": [1, 2, 3]}
        chat = "chat" in route or "messages" in body
        for _ in range(self.rnd.choice([1, 1, 2, 3, 5])):
            name = self.rnd.choice(FIELDS + (("messages",) * 5 if chat else ()))
            if name == "messages" and self.rnd.random() < 0.7:
                body[name] = [self.message() for _ in range(self.rnd.randint(0, 3))]
            else:
                body[name] = self.hostile()
        if self.rnd.random() < 0.3:
            body["stream"] = True
        return body

    def headers(self) -> str:
        """0 to 3 extra header lines (latin-1 text)."""
        lines = [
            f"{self.rnd.choice(HEADER_NAMES)}: {self.rnd.choice(HEADER_VALUES)}\r\n"
            for _ in range(self.rnd.choice([0, 0, 1, 2, 3]))
        ]
        if self.api_key and self.rnd.random() < 0.9:
            lines.insert(0, f"authorization: Bearer {self.api_key}\r\n")
        return "".join(lines)

    def literal_value(self, depth: int = 0) -> str:
        r = self.rnd.random()
        if depth > 3 or r < 0.5:
            return self.rnd.choice(LITERALS)
        if r < 0.75:
            items = (self.literal_value(depth + 1) for _ in range(self.rnd.randint(0, 3)))
            return "[" + ",".join(items) + "]"
        pairs = (
            f'"{self.rnd.choice(FIELDS)}":{self.literal_value(depth + 1)}'
            for _ in range(self.rnd.randint(0, 3))
        )
        return "{" + ",".join(pairs) + "}"

    def raw_body(self) -> bytes:
        items = {"model": json.dumps(self.model), "max_tokens": str(self.rnd.choice([1, 2, 4]))}
        r = self.rnd.random()
        if r < 0.4:
            items["prompt"] = '"hi"'
        elif r < 0.8:
            items["messages"] = '[{"role":"user","content":"hi"}]'
        for _ in range(self.rnd.randint(0, 4)):
            items[self.rnd.choice(FIELDS)] = self.literal_value()
        pairs = [f'"{k}":{v}' for k, v in items.items()]
        if self.rnd.random() < 0.1:
            pairs.append(pairs[0])  # a duplicate key
        text = "{" + ",".join(pairs) + "}"
        m = self.rnd.random()
        if m < 0.05:
            text = text[: self.rnd.randint(0, len(text))]
        elif m < 0.08:
            text = "\ufeff" + text
        elif m < 0.10:
            text = "[" * self.rnd.choice([100, 1000, 100_000])
        elif m < 0.12:
            return text.encode() + b"\xff\xfe"
        elif m < 0.14:
            prompt = "a" * self.rnd.choice([10**5, 10**6])
            text = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": 1})
        return text.encode("utf-8", "surrogatepass")


def encode_json(body: dict[str, Any]) -> Optional[bytes]:
    try:
        return json.dumps(body).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError):
        return None


def exchange(
    host: str,
    port: int,
    route: str,
    data: bytes,
    content_type: str,
    chunked: bool,
    extra_headers: str = "",
) -> tuple[Any, bytes]:
    """(status or why none came, the whole answer) of one POST on its own connection."""
    head = f"POST {route} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n"
    head += extra_headers + "Connection: close\r\n"
    if chunked:
        pieces = [data[i : i + 999] for i in range(0, len(data), 999)]
        payload = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        head += "Transfer-Encoding: chunked\r\n\r\n"
    else:
        payload = data
        head += f"Content-Length: {len(data)}\r\n\r\n"
    answer = b""
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
            sock.sendall(head.encode("latin-1") + payload)
            while chunk := sock.recv(65536):
                answer += chunk
    except socket.timeout:
        return "timeout", answer
    except OSError as exc:
        if not answer:
            return f"connection: {exc}", answer
    while answer.startswith(b"HTTP/1.1 100"):  # an interim answer to Expect: 100-continue
        answer = answer.partition(b"\r\n\r\n")[2]
    try:
        return int(answer.split(b" ", 2)[1]), answer
    except (IndexError, ValueError):
        return "no status line", answer


def problem_of(status: Any, answer: bytes, streamed: bool) -> Optional[str]:
    """What is wrong with an answer, or None."""
    if not isinstance(status, int):
        return str(status)
    if status >= 500:
        return f"status {status}"
    _, _, payload = answer.partition(b"\r\n\r\n")
    if status >= 400:
        return None if b"message" in payload else f"status {status} without a message"
    if status == 200 and streamed:
        if b"data: [DONE]" not in payload:
            return "a 200 stream without [DONE]"
        if b'"error"' in payload:
            return "an error inside a 200 stream"
    return None


def run(
    url: str,
    requests: int,
    seed: int,
    model: Optional[str] = None,
    api_key: Optional[str] = None,
) -> Tally:
    host, port = host_port(url)
    maker = BodyMaker(model or served_model(host, port, api_key), seed, api_key)
    rnd, tally = maker.rnd, Tally()
    for _ in range(requests):
        streamed = False
        if rnd.random() < 0.6:
            route = rnd.choice(ROUTES)
            body = maker.json_body(route)
            data = encode_json(body)
            if data is None:
                continue
            streamed = body.get("stream") is True and route in GENERATION_ROUTES
        else:
            route = rnd.choice(ROUTES * 4 + OTHER_ROUTES)
            data = maker.raw_body()
        chunked, content_type = rnd.random() < 0.2, rnd.choice(CONTENT_TYPES)
        start = time.monotonic()
        status, answer = exchange(host, port, route, data, content_type, chunked, maker.headers())
        took = time.monotonic() - start
        tally.count(status)
        tally.slowest_s = max(tally.slowest_s, took)
        problem = problem_of(status, answer, streamed)
        if problem is not None:
            tally.problems.append(
                {"problem": problem, "route": route, "body": data[:500].decode("utf-8", "replace"),
                 "answer": answer[:500].decode("utf-8", "replace"), "seconds": round(took, 2)}
            )  # fmt: skip
    return tally


def served_model(host: str, port: int, api_key: Optional[str] = None) -> str:
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    try:
        auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        conn.request("GET", "/v1/models", headers=auth)
        return json.loads(conn.getresponse().read())["data"][0]["id"]
    finally:
        conn.close()


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def status_class(status: Any) -> str:
    return f"{status // 100}xx" if isinstance(status, int) else str(status)


def compare(url: str, other: str, requests: int, seed: int) -> dict[str, Any]:
    """The same JSON bodies to two servers of one model (ours and vLLM): how often each
    pair of answer classes came, with a few bodies of each pair that differ."""
    ours, theirs = host_port(url), host_port(other)
    maker = BodyMaker(served_model(*ours), seed)
    pairs: dict[str, int] = {}
    examples: dict[str, list[dict[str, str]]] = {}
    for _ in range(requests):
        route = maker.rnd.choice(ROUTES[:4])
        data = encode_json(maker.json_body(route))
        if data is None:
            continue
        a = exchange(*ours, route, data, "application/json", False)
        b = exchange(*theirs, route, data, "application/json", False)
        key = f"{route} {status_class(a[0])} vs {status_class(b[0])}"
        pairs[key] = pairs.get(key, 0) + 1
        if status_class(a[0]) != status_class(b[0]) and len(examples.setdefault(key, [])) < 5:
            examples[key].append(
                {"body": data[:400].decode("utf-8", "replace"),
                 "ours": a[1].partition(b"\r\n\r\n")[2][:300].decode("utf-8", "replace"),
                 "theirs": b[1].partition(b"\r\n\r\n")[2][:300].decode("utf-8", "replace")}
            )  # fmt: skip
    return {"pairs": dict(sorted(pairs.items())), "examples": examples}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--against",
        metavar="URL",
        help="another server of the same model (vLLM): send both the same JSON bodies and "
        "print how their answers' classes pair up",
    )
    ap.add_argument("--api-key", help="presented by most requests (a gateway with tenants)")
    args = ap.parse_args()
    if args.against:
        print(json.dumps(compare(args.url, args.against, args.requests, args.seed), indent=1))
        return 0
    tally = run(args.url, args.requests, args.seed, api_key=args.api_key)
    print(json.dumps({"statuses": tally.statuses, "slowest_s": round(tally.slowest_s, 2),
                      "problems": tally.problems}, indent=1))  # fmt: skip
    return 1 if tally.problems else 0


if __name__ == "__main__":
    sys.exit(main())
