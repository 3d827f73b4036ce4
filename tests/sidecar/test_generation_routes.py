"""What the front-ends pass to the backends (net/routes.py, one list of generation routes):
every generation route, the token route /inference/v1/generate included, is admitted and
charged by flow control and loses client `kv_transfer_params` before an engine sees it, at
the gateway, through the endpoint picker and at the sidecar; the gateway forwards only the
client routes (an engine's KV lease release is not one); and neither the gateway nor the
picker hands the client's API key to a call of its own (an engine's /tokenize)."""

from __future__ import annotations

import json

import httpx

from pdpool.ports import free_port
from pdpool.sidecar.epp import protocol
from pdpool.sidecar.epp.exchange import Exchange
from pdpool.sidecar.epp.server import EndpointPicker, EppSettings
from pdpool.sidecar.gateway.app import Gateway, GatewaySettings
from pdpool.sidecar.proxy.app import Sidecar
from pdpool.sidecar.proxy.settings import SidecarSettings

from tests.support.vllm_standin import answer_lifespan, read_body, send_json

ext = protocol.ext
KEY = "tenant-a-key-0123456789"
# Where a client would have an engine open its KV connections (a cloud metadata address).
HOSTILE = {"do_remote_prefill": True, "remote_host": "169.254.169.254", "remote_port": 80}
GENERATE = {
    "token_ids": list(range(1, 41)),
    "sampling_params": {"max_tokens": 20, "extra_args": {"kv_transfer_params": HOSTILE}},
    "kv_transfer_params": HOSTILE,
}  # 40 prompt + 20 output tokens: one fits in 100 a minute, two do not
TENANTS = f"tenants: [{{name: a, keys: ['{KEY}'], tokensPerMinute: 100}}]\n"
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


class Recorder:
    """A real listener standing for an engine (or, to the picker, a sidecar): records every
    request but the probes (method, path, body, headers) and answers it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, object, dict[str, str]]] = []

    def paths(self) -> list[str]:
        return [path for _, path, _, _ in self.seen]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await answer_lifespan(receive, send)
        raw = await read_body(receive)
        path = scope["path"]
        if path in ("/health", "/ready", "/metrics"):
            return await send_json(send, 200, {})
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        self.seen.append((scope["method"], path, json.loads(raw) if raw else None, headers))
        if path == "/tokenize":
            return await send_json(send, 200, {"count": 3, "tokens": [1, 2, 3]})
        await send_json(send, 200, {"choices": [{"index": 0, "token_ids": [7]}]})


def no_client_kv(body: object) -> bool:
    return "169.254.169.254" not in json.dumps(body)


async def test_the_gateway_admits_and_cleans_the_token_route_and_forwards_client_routes_only(
    servers, tmp_path
):
    engine = Recorder()
    e = await servers(engine)
    side = await servers(Sidecar(SidecarSettings(decode_url=e.url, mode="aggregated")))
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    gw = await servers(
        Gateway(GatewaySettings(decode_urls=[side.host_port], tenants_file=str(tenants)))
    )
    auth = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=30) as c:
        first = await c.post(gw.url + "/inference/v1/generate", json=GENERATE, headers=auth)
        second = await c.post(gw.url + "/inference/v1/generate", json=GENERATE, headers=auth)
        release = await c.post(gw.url + "/pdpool/v1/kv/release", json={}, headers=auth)
        other = await c.get(gw.url + "/v1/whatever", headers=auth)
        models = await c.get(gw.url + "/v1/models", headers=auth)
    assert first.status_code == 200, first.text
    assert second.status_code == 429, second.text  # charged like /v1/completions
    assert second.json()["error"]["code"] == "tokens_per_minute"
    assert release.status_code == other.status_code == 404
    assert models.status_code == 200
    assert engine.paths() == ["/inference/v1/generate", "/v1/models"]
    body = engine.seen[0][2]
    assert no_client_kv(body) and body["token_ids"] == GENERATE["token_ids"]


async def test_the_sidecar_cleans_the_token_route(servers):
    engine = Recorder()
    e = await servers(engine)
    side = await servers(Sidecar(SidecarSettings(decode_url=e.url, mode="aggregated")))
    async with httpx.AsyncClient(timeout=30) as c:
        ok = await c.post(side.url + "/inference/v1/generate", json=GENERATE)
        bad = await c.post(side.url + "/inference/v1/generate", json={"token_ids": "x"})
        metrics = (await c.get(side.url + "/metrics")).text
    assert ok.status_code == 200 and bad.status_code == 400
    assert bad.json()["error"]["param"] == "token_ids"
    assert len(engine.seen) == 1 and no_client_kv(engine.seen[0][2])
    assert "pdpool_sidecar_client_kv_params_dropped_total 1.0" in metrics


def _headers(**values: str) -> object:
    return ext.HttpHeaders(
        headers=ext.HeaderMap(
            headers=[ext.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
        )
    )


async def _through_picker(picker: EndpointPicker, path: str, body: dict, **headers: str) -> list:
    ex = Exchange(picker)
    start = _headers(**{":path": path, ":method": "POST", **headers})
    await ex.handle(ext.ProcessingRequest(request_headers=start))
    raw = json.dumps(body).encode()
    return await ex.handle(
        ext.ProcessingRequest(request_body=ext.HttpBody(body=raw, end_of_stream=True))
    )


async def test_the_picker_admits_and_cleans_the_token_route(tmp_path):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    picker = EndpointPicker(EppSettings(decode_urls=["127.0.0.1:1"], tenants_file=str(tenants)))
    auth = {"authorization": f"Bearer {KEY}"}
    answers = await _through_picker(picker, "/inference/v1/generate", GENERATE, **auth)
    assert answers[0].WhichOneof("response") == "request_headers"
    sent = b"".join(
        a.request_body.response.body_mutation.streamed_response.body for a in answers[1:]
    )
    assert no_client_kv(json.loads(sent)) and json.loads(sent)["token_ids"]
    mutation = answers[0].request_headers.response.header_mutation
    lengths = [h.header.raw_value for h in mutation.set_headers if h.header.key == "content-length"]
    assert lengths == [str(len(sent)).encode()]  # Envoy sends the cleaned body's length
    shed = await _through_picker(picker, "/inference/v1/generate", GENERATE, **auth)
    assert shed[0].immediate_response.status.code == 429


async def test_neither_front_end_hands_the_client_key_to_tokenize(servers, tmp_path):
    backend = Recorder()
    b = await servers(backend)
    kv = {"kv_events": {b.host_port: f"tcp://127.0.0.1:{free_port()}"}}
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    # The picker: the key names the tenant, then tokenizing the chat asks the backend.
    picker = EndpointPicker(
        EppSettings(
            decode_urls=[b.host_port],
            tenants_file=str(tenants),
            grpc_port=free_port(),
            health_port=None,
            **kv,
        )
    )
    await servers(picker)
    creds = {"authorization": f"Bearer {KEY}", "x-api-key": KEY, "x-request-id": "r-1"}
    answers = await _through_picker(picker, "/v1/chat/completions", CHAT, **creds)
    assert answers[0].WhichOneof("response") == "request_headers"
    # The gateway, with no keys of its own to check: the request's own leg may carry the
    # key to a backend that checks it, its /tokenize call never does.
    gw = await servers(Gateway(GatewaySettings(decode_urls=[b.host_port], **kv)))
    async with httpx.AsyncClient(timeout=30) as c:
        answer = await c.post(gw.url + "/v1/chat/completions", json=CHAT, headers=creds)
    assert answer.status_code == 200
    tokenized = [h for _, path, _, h in backend.seen if path == "/tokenize"]
    assert len(tokenized) == 2
    for headers in tokenized:
        assert "authorization" not in headers and "x-api-key" not in headers, headers
        assert headers["x-request-id"] == "r-1"  # what ties its logs to the request
