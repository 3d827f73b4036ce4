"""A stream's first event is never held back by anything but its own upstream: not by the
capability probe (`--engine-rejects auto`) while the engine is slow to answer it, not by
the relay while the engine pauses after its first token.

The upstream is a GATED stand-in for vLLM (a labelled fake of a third party: it ignores
`cache_hit_threshold`, as vLLM does): the test holds its `/v1/models` answer, or every
stream after its first event (and every non-streamed answer, which a real engine gives
only once it has generated), until it opens a gate. The assertions are about order (the
client had its first event before the gate opened), never about how fast; a gate opens by
itself after GATE_S so that a sidecar that does wait fails instead of hanging the test."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from pdpool.sidecar.proxy.app import Sidecar
from pdpool.sidecar.proxy.settings import SidecarSettings
from tests.support.vllm_standin import answer_lifespan, read_body, send_json

GATE_S = 10.0  # generous: on a busy CI machine a request still takes milliseconds
PROMPT = "w1 w2 w3 w4"


class GatedUpstream:
    """ASGI app: vLLM's routes as the sidecar uses them, each behind a gate the test opens."""

    def __init__(self, models_answer: str = "vllm") -> None:
        self.models_gate = asyncio.Event()
        self.resume_gate = asyncio.Event()
        self.models_asked = asyncio.Event()
        self.models_answer = models_answer  # "vllm", or "odd": an answer the probe cannot read
        self.probes = 0  # the sidecar's capability probes (POSTs)
        self.generations = 0  # every other POST

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await answer_lifespan(receive, send)
        body = await read_body(receive)
        if scope["path"] == "/health":
            return await send_json(send, 200, {})
        if scope["path"] == "/v1/models":
            return await self._models(send)
        headers = dict(scope["headers"])
        if headers.get(b"x-request-id", b"").startswith(b"pdpool-probe-"):
            self.probes += 1
        else:
            self.generations += 1
        request = json.loads(body)
        if request.get("stream"):
            return await self._stream(send)
        await self.resume_gate.wait()  # a whole answer exists only once it is generated
        await send_json(send, 200, _completion("x", "length"))

    async def _models(self, send) -> None:
        self.models_asked.set()
        await self.models_gate.wait()
        if self.models_answer == "odd":
            return await send_json(send, 404, {"detail": "Not Found"})
        await send_json(send, 200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def _stream(self, send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": _event(" a", None), "more_body": True})
        await self.resume_gate.wait()
        rest = _event(" b", "length") + b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": rest, "more_body": False})


def _completion(text: str, finish: str | None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [choice]}


def _event(text: str, finish: str | None) -> bytes:
    return b"data: " + json.dumps(_completion(text, finish)).encode() + b"\n\n"


async def _sidecar(servers, upstream: GatedUpstream, engine_rejects: str):
    up = await servers(upstream)
    sidecar = Sidecar(
        SidecarSettings(decode_url=up.url, engine_rejects=engine_rejects, cache_hit_threshold=0.5)
    )
    # The probe waits as long as the engine does: only the gates decide when it ends.
    sidecar.capability.probe_timeout_s = 60.0
    return sidecar, await servers(sidecar)


async def _first_event_then_rest(
    client: httpx.AsyncClient,
    url: str,
    gate: asyncio.Event,
    first_seen: asyncio.Event | None = None,
) -> tuple[bool, str]:
    """Streams one request: (whether `gate` was still closed when its first event came,
    the whole text received). `first_seen` is set at the first event."""
    body = {"prompt": PROMPT, "max_tokens": 2, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        received = ""
        closed_at_first = None
        async for text in r.aiter_text():
            received += text
            if closed_at_first is None and "\n\n" in received:
                closed_at_first = not gate.is_set()
                if first_seen is not None:
                    first_seen.set()
    assert closed_at_first is not None, received
    return closed_at_first, received


@pytest.mark.parametrize("models_answer", ["vllm", "odd"])
async def test_requests_never_wait_for_a_capability_probe(servers, models_answer):
    """The engine holds its /v1/models answer (behind a burst, say) while it serves
    completions at once: requests go on, decode-first, without waiting for the probe."""
    upstream = GatedUpstream(models_answer)
    upstream.resume_gate.set()  # completions are answered at once
    sidecar, side = await _sidecar(servers, upstream, "auto")
    await asyncio.wait_for(upstream.models_asked.wait(), GATE_S)  # the probe is in flight
    opener = asyncio.get_running_loop().call_later(GATE_S, upstream.models_gate.set)
    try:
        async with httpx.AsyncClient(timeout=60) as c:
            streams = [_first_event_then_rest(c, side.url, upstream.models_gate) for _ in range(8)]
            whole = c.post(side.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
            *streamed, answer = await asyncio.gather(*streams, whole)
            answered_before_probe = not upstream.models_gate.is_set()
    finally:
        opener.cancel()
    assert [closed for closed, _ in streamed] == [True] * 8, "a stream waited for the probe"
    assert answered_before_probe and answer.status_code == 200
    assert all(text.rstrip().endswith("data: [DONE]") for _, text in streamed)
    assert upstream.generations == 9
    assert sidecar.capability.known is None  # still unknown: plain decode-first meanwhile
    # Once the engine answers, the background probe concludes (vLLM ignores the threshold)
    # or, for an answer it cannot read, stays unknown and tries again later.
    upstream.models_gate.set()
    if models_answer == "vllm":
        for _ in range(200):
            if sidecar.capability.known is not None:
                break
            await asyncio.sleep(0.05)
        assert sidecar.capability.known is False and upstream.probes == 1
    else:
        await asyncio.sleep(0.3)
        assert sidecar.capability.known is None and upstream.probes == 0


@pytest.mark.parametrize("engine_rejects", ["auto", "yes"])
async def test_first_event_reaches_the_client_while_the_upstream_pauses(servers, engine_rejects):
    """The engine sends a stream's first event, then pauses (and so does every other answer
    it owes, the probe's included): the client has that first event during the pause."""
    upstream = GatedUpstream()
    upstream.models_gate.set()
    _, side = await _sidecar(servers, upstream, engine_rejects)
    first_seen = asyncio.Event()
    async with httpx.AsyncClient(timeout=60) as c:
        task = asyncio.ensure_future(
            _first_event_then_rest(c, side.url, upstream.resume_gate, first_seen)
        )
        # The pause ends once the client has the first event (or after GATE_S).
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(first_seen.wait(), GATE_S)
        upstream.resume_gate.set()
        closed_at_first, text = await task
    assert closed_at_first, "the first event was held back until the upstream went on"
    assert '" a"' in text and '" b"' in text and text.rstrip().endswith("data: [DONE]")
