"""A client that stops reading a stream holds its upstream back through the sidecar (and the
gateway): the relay stops reading the engine's answer while the client's socket is full,
then goes on, and every byte arrives in order.

The upstream is a labelled fake of an engine (an ASGI app streaming big completion events as
fast as it may send them); the sidecar and both servers are real (uvicorn)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from pdpool.sidecar.gateway.app import Gateway
from pdpool.sidecar.gateway.settings import GatewaySettings
from pdpool.sidecar.proxy.app import Sidecar
from pdpool.sidecar.proxy.settings import SidecarSettings
from tests.support.vllm_standin import answer_lifespan, read_body, send_json

EVENTS = 256
FILLER = "x" * (256 * 1024)  # 64 MiB in all: far past every socket buffer on the way


def _event(i: int, finish: str | None) -> bytes:
    choice = {"index": 0, "text": f"{i:06d}{FILLER}", "logprobs": None, "finish_reason": finish}
    body = {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class FloodingUpstream:
    def __init__(self) -> None:
        self.sent = 0  # bytes its server has taken (send returns once they were written)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await answer_lifespan(receive, send)
        await read_body(receive)
        if scope["path"] != "/v1/completions":
            return await send_json(send, 200, {"object": "list", "data": []})
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(EVENTS):
            last = i == EVENTS - 1
            data = _event(i, "length" if last else None) + (b"data: [DONE]\n\n" if last else b"")
            await send({"type": "http.response.body", "body": data, "more_body": not last})
            self.sent += len(data)


@pytest.mark.parametrize(
    "front", ["sidecar aggregated", "sidecar decode-first", "gateway", "gateway migrating"]
)
async def test_a_client_that_stops_reading_holds_the_upstream_back(servers, front):
    upstream = FloodingUpstream()
    up = await servers(upstream)
    if front.startswith("gateway"):  # a stream relayed whole, or event by event to migrate
        migrate = front == "gateway migrating"
        app: Any = Gateway(GatewaySettings(decode_urls=[up.host_port], migrate=migrate))
    else:
        mode = front.split()[1]
        app = Sidecar(SidecarSettings(decode_url=up.url, mode=mode, engine_rejects="yes"))
    side = await servers(app)
    body = {"prompt": "p", "max_tokens": EVENTS, "stream": True}
    client = httpx.AsyncClient(timeout=60)
    async with client, client.stream("POST", side.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        await asyncio.sleep(1.0)  # the client reads nothing
        held_at = upstream.sent
        total = EVENTS * len(_event(0, None))
        assert held_at < total // 2, f"the upstream sent {held_at} of {total} bytes"
        received = b"".join([chunk async for chunk in r.aiter_bytes()])
    events = [e for e in received.split(b"\n\n") if e.startswith(b"data: {")]
    indices = [int(json.loads(e[6:])["choices"][0]["text"][:6]) for e in events]
    assert indices == list(range(EVENTS))  # every event, in order, once the client read on
    assert received.rstrip().endswith(b"data: [DONE]")
