"""A minimal stand-in for a **vLLM** OpenAI server (a third party that cannot run here).

FAKE, for sidecar tests only: it imitates vLLM's wire behaviour that the sidecar relies on
(cache-hit-threshold rejection, NixlConnector `kv_transfer_params` in both directions,
SSE streams, usage with cached_tokens) so that the proxy can be tested against the engine
it must also work with. Our own engine is tested through real `pdpool serve` processes in
test_e2e_engine.py. Tokens are whitespace-separated words (token ids: a shared vocabulary
that numbers words as they are first seen); the prefix cache keeps 4-word blocks; the
"model" emits each word as a deterministic function of all words before it (so a
continuation of prompt + output so far goes on exactly, as greedy decoding does). Like vLLM
it answers `return_token_ids` with `prompt_token_ids` and per-chunk `token_ids`.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
from dataclasses import dataclass, field
from typing import Any, Optional

BLOCK = 4
VOCAB: dict[str, int] = {}
WORDS: list[str] = []


def token_id(word: str) -> int:
    if word not in VOCAB:
        VOCAB[word] = len(WORDS)
        WORDS.append(word)
    return VOCAB[word]


def prompt_words(route: str, body: dict) -> list[str]:
    if route.endswith("/chat/completions"):
        return " ".join(f"<{m.get('role')}> {m.get('content')}" for m in body["messages"]).split()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) and 0 <= t < len(WORDS) for t in prompt):
        return [WORDS[t] for t in prompt]
    return (prompt if isinstance(prompt, str) else " ".join(map(str, prompt))).split()


def greedy_output(words: list[str], n: int) -> list[str]:
    out: list[str] = []
    for _ in range(n):
        digest = hashlib.sha256(" ".join(words + out).encode()).hexdigest()
        out.append(f"w{digest[:4]}")
    return out


@dataclass
class StandInState:
    name: str
    host: str = "127.0.0.1"
    port: int = 0
    global_threshold: float = 0.0
    cached_prefixes: set = field(default_factory=set)  # tuples of block-aligned prefixes
    received: list = field(default_factory=list)  # (route, body, headers)
    probes: int = 0  # sidecar capability probes
    # False: stock vLLM, which ignores cache_hit_threshold (never rejects)
    honours_threshold: bool = True
    hang: bool = False  # accept requests and never answer (a stuck engine)
    fail_status: Optional[int] = None
    token_delay_s: float = 0.0
    drop_streams: int = 0  # next N streams: send the head, then die (an engine crash)
    die_after_tokens: Optional[int] = None  # next stream: die after this many tokens
    coalesce: bool = False  # a stream's events in one write (as a busy network delivers)
    # What its /metrics reports under vLLM's names (flow control reads saturation from them).
    waiting_reported: int = 0
    kv_usage_reported: float = 0.0
    cancelled: int = 0
    pulled_tokens: int = 0  # tokens this engine pulled from a peer
    computed_tokens: int = 0
    _ids = itertools.count()

    def cached_len(self, words: list[str]) -> int:
        n = 0
        for end in range(BLOCK, len(words) + 1, BLOCK):
            if tuple(words[:end]) in self.cached_prefixes:
                n = end
            else:
                break
        return n

    def store(self, words: list[str]) -> None:
        for end in range(BLOCK, len(words) + 1, BLOCK):
            self.cached_prefixes.add(tuple(words[:end]))


class VllmStandIn:
    """ASGI app of the stand-in engine."""

    def __init__(self, name: str, global_threshold: float = 0.0) -> None:
        self.state = StandInState(name=name, global_threshold=global_threshold)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await answer_lifespan(receive, send)
        body = await read_body(receive)
        route = scope["path"]
        if route == "/health":
            return await send_json(send, 200, {})
        if route == "/metrics":
            st = self.state
            labels = '{engine="0",model_name="standin"}'
            text = (
                f"vllm:num_requests_waiting{labels} {st.waiting_reported}\n"
                f"vllm:kv_cache_usage_perc{labels} {st.kv_usage_reported}\n"
            )
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": text.encode()})
            return
        if route == "/v1/models":
            return await send_json(send, 200, {"object": "list", "data": [{"id": "standin"}]})
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        req = json.loads(body)
        if headers.get("x-request-id", "").startswith("pdpool-probe-"):
            self.state.probes += 1  # the sidecar's capability probe (capability.py)
        else:
            self.state.received.append((route, req, headers))
        if self.state.hang:
            await _until_disconnect(receive)
            self.state.cancelled += 1
            return
        if self.state.fail_status:
            return await send_json(
                send,
                self.state.fail_status,
                {
                    "error": {
                        "message": "boom",
                        "type": "server_error",
                        "param": None,
                        "code": self.state.fail_status,
                    }
                },
            )
        # Like vLLM, abort the generation when the client (the sidecar) goes away.
        work = asyncio.ensure_future(self._generate(route, req, headers, send))
        watcher = asyncio.ensure_future(_until_disconnect(receive))
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            watcher.cancel()
            return work.result()
        work.cancel()
        self.state.cancelled += 1

    async def _generate(self, route, req, headers, send):
        st = self.state
        words = prompt_words(route, req)
        kv_in = req.get("kv_transfer_params") or {}
        threshold = req.get("cache_hit_threshold")
        threshold = st.global_threshold if threshold is None else threshold
        local = st.cached_len(words)
        cached = local
        if kv_in.get("do_remote_prefill"):  # decode leg: pull prefill's blocks
            cached = len(words) - 1
            st.pulled_tokens += cached - local
        elif kv_in.get("remote_num_tokens"):  # prefill leg pulling decode's prefix
            cached = max(local, int(kv_in["remote_num_tokens"]))
            st.pulled_tokens += cached - local
        rid = headers.get("x-request-id", f"req-{next(st._ids)}")
        chat = route.endswith("/chat/completions")
        usage = {
            "prompt_tokens": len(words),
            "completion_tokens": 0,
            "total_tokens": len(words),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if st.honours_threshold and threshold and cached / max(len(words), 1) < threshold:
            kv_out = (
                {
                    "do_remote_decode": True,
                    "do_remote_prefill": False,
                    "remote_engine_id": st.name,
                    "remote_host": st.host,
                    "remote_port": st.port,
                    "remote_block_ids": list(range(local // BLOCK)),
                    "remote_num_tokens": local,
                }
                if local
                else None
            )
            return await self._reply(
                send, req, chat, rid, [], "cache_threshold", usage, kv_out, words
            )
        st.computed_tokens += len(words) - cached
        st.store(words)
        n = int(req.get("max_tokens") or req.get("max_completion_tokens") or 8)
        out = greedy_output(words, n)
        usage["completion_tokens"] = n
        usage["total_tokens"] = len(words) + n
        kv_out = None
        if kv_in.get("do_remote_decode"):
            kv_out = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": st.name,
                "remote_request_id": rid,
                "remote_block_ids": list(range(len(words) // BLOCK)),
                "remote_host": st.host,
                "remote_port": st.port,
                "tp_size": 1,
            }
        await self._reply(send, req, chat, rid, out, "length", usage, kv_out, words)

    async def _reply(self, send, req, chat, rid, out, finish, usage, kv_out, words):
        if not req.get("stream"):
            return await _reply_whole(send, chat, rid, out, finish, usage, kv_out)
        obj = "chat.completion" if chat else "text_completion"
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        if self.state.drop_streams:
            self.state.drop_streams -= 1
            raise RuntimeError("stand-in engine crashed mid-stream")
        obj += ".chunk" if chat else ""
        ids = bool(req.get("return_token_ids"))
        stream = _StreamWriter(send, self.state, rid, obj, chat, ids, [token_id(w) for w in words])
        if chat:
            await stream.event(
                {"delta": {"role": "assistant", "content": ""}},
                extra={"prompt_token_ids": stream.prompt_ids} if ids else None,
            )
        for i, word in enumerate(out):
            if self.state.token_delay_s:
                await asyncio.sleep(self.state.token_delay_s)
            if self.state.die_after_tokens == i:
                self.state.die_after_tokens = None
                raise RuntimeError("stand-in engine crashed mid-stream")
            last = i == len(out) - 1
            # A token-id prompt goes on from earlier text: its first word gets a space too.
            text = (" " if i or isinstance(req.get("prompt"), list) else "") + word
            await stream.event(
                {"delta": {"content": text}} if chat else {"text": text},
                finish if last else None,
                {"kv_transfer_params": kv_out} if last else None,
                token_ids=[token_id(word)],
            )
            stream.prompt_ids = None
        if not out:
            await stream.event(
                {"delta": {}} if chat else {"text": ""}, finish, {"kv_transfer_params": kv_out}
            )
        if (req.get("stream_options") or {}).get("include_usage"):
            data = {"id": rid, "object": obj, "model": "standin", "choices": [], "usage": usage}
            await stream.write(b"data: " + json.dumps(data).encode() + b"\n\n")
        await stream.write(b"data: [DONE]\n\n", more=False)


class _StreamWriter:
    """Writes the SSE events of one streamed answer; while the stand-in coalesces, they are
    held and sent together with the last."""

    def __init__(self, send, state, rid, obj, chat, ids, prompt_ids):
        self.send, self.state = send, state
        self.rid, self.obj, self.chat, self.ids = rid, obj, chat, ids
        self.prompt_ids = prompt_ids  # sent with the first token only
        self.pending: list[bytes] = []

    async def write(self, body: bytes, more: bool = True) -> None:
        if self.state.coalesce and more:
            self.pending.append(body)
            return
        await self.send(
            {"type": "http.response.body", "more_body": more, "body": b"".join(self.pending) + body}
        )
        self.pending.clear()

    async def event(self, choice_part, finish_reason=None, extra=None, token_ids=None):
        choice = {"index": 0, **choice_part, "finish_reason": finish_reason}
        if self.ids and token_ids is not None:
            choice["token_ids"] = token_ids
            if not self.chat and self.prompt_ids is not None:
                choice["prompt_token_ids"] = self.prompt_ids
        data = {
            "id": self.rid,
            "object": self.obj,
            "model": "standin",
            "choices": [choice],
            **(extra or {}),
        }
        await self.write(b"data: " + json.dumps(data).encode() + b"\n\n")


async def _reply_whole(send, chat, rid, out, finish, usage, kv_out):
    """A non-streamed answer."""
    choice = (
        {
            "index": 0,
            "message": {"role": "assistant", "content": " ".join(out)},
            "finish_reason": finish,
        }
        if chat
        else {"index": 0, "text": " ".join(out), "finish_reason": finish}
    )
    await send_json(
        send,
        200,
        {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "model": "standin",
            "choices": [choice],
            "usage": usage,
            "kv_transfer_params": kv_out,
        },
    )


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def read_body(receive) -> bytes:
    """An ASGI request's whole body."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body


async def answer_lifespan(receive, send) -> None:
    """The ASGI lifespan of a server with nothing to start or stop."""
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def send_json(send, status: int, obj: Any) -> None:
    body = json.dumps(obj).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
