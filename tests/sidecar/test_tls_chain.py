"""In-pool TLS: gateway -> sidecar -> engines (decode and prefill) all over HTTPS, each hop
verified against the pool's CA; a peer with a certificate from another CA is refused."""

from __future__ import annotations

import asyncio
import contextlib
import ssl

import httpx
import pytest
import uvicorn

from pdpool.sidecar.gateway.app import Gateway, GatewaySettings
from pdpool.sidecar.proxy.app import Sidecar
from pdpool.sidecar.proxy.settings import SidecarSettings
from pdpool.tlsutil import make_ca_and_certificate

from tests.support.vllm_standin import VllmStandIn, answer_lifespan, send_json

PROMPT = "the history of the pool " * 20


def make_ca(d, name, san="IP:127.0.0.1,DNS:localhost"):
    """A CA called `name` and a leaf it signs for `san` (ca.crt, (leaf.crt, leaf.key))."""
    return make_ca_and_certificate(
        d, san, ca_name=name, ca_cn=name, name=f"{name}-leaf", cn="pool", days=1, server_auth=False
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, leaf = make_ca(d, "pool-ca")
    _, foreign_leaf = make_ca(d, "other-ca")
    return ca, leaf, foreign_leaf


@pytest.fixture(scope="module")
def service_named_pki(tmp_path_factory):
    """What a Kubernetes pool has: a CA of its own and a certificate naming its Services,
    while peers are reached at pod IPs."""
    d = tmp_path_factory.mktemp("pki-svc")
    ca, leaf = make_ca(d, "svc-ca", san="DNS:demo-prefill.llm.svc,DNS:demo-decode.llm.svc")
    _, foreign = make_ca(d, "svc-other", san="DNS:demo-prefill.llm.svc")
    return ca, leaf, foreign


class TlsServed:
    def __init__(self, server, task):
        self.server, self.task = server, task
        self.port = server.servers[0].sockets[0].getsockname()[1]
        self.host_port = f"127.0.0.1:{self.port}"
        self.url = f"https://{self.host_port}"


@pytest.fixture
async def tls_servers():
    started = []

    async def start(app, cert):
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="on",
            access_log=False,
            timeout_graceful_shutdown=1,
            ssl_certfile=cert[0],
            ssl_keyfile=cert[1],
        )
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        started.append((server, task))
        return TlsServed(server, task)

    yield start
    for server, task in reversed(started):
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)


async def test_every_hop_is_https_and_verified(tls_servers, pki):
    ca, leaf, _ = pki
    decode, prefill = VllmStandIn("decode-0"), VllmStandIn("prefill-0")
    dec = await tls_servers(decode, leaf)
    pre = await tls_servers(prefill, leaf)
    decode.state.port, prefill.state.port = dec.port, pre.port
    side = await tls_servers(
        Sidecar(
            SidecarSettings(
                decode_url=dec.url,
                prefill_urls=[pre.host_port],
                mode="prefill-first",
                decode_retry_s=0.5,
                tls_ca_file=str(ca),
            )
        ),
        leaf,
    )
    gateway = Gateway(GatewaySettings(decode_urls=[side.host_port], tls_ca_file=str(ca)))
    gw = await tls_servers(gateway, leaf)
    client_ctx = ssl.create_default_context(cafile=str(ca))
    async with httpx.AsyncClient(verify=client_ctx) as c:
        r = await c.post(gw.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        s = await c.post(
            gw.url + "/v1/completions",
            json={"prompt": PROMPT + "again", "max_tokens": 3, "stream": True},
        )
        ready = await c.get(gw.url + "/ready")
    assert r.status_code == 200 and r.headers["x-pdpool-path"] != "decode"
    assert s.status_code == 200 and s.text.rstrip().endswith("data: [DONE]")
    assert ready.status_code == 200 and side.host_port in ready.json()["healthy"]
    assert prefill.state.received and decode.state.received  # both legs ran over TLS


async def test_a_peer_with_a_foreign_certificate_is_refused(tls_servers, pki):
    ca, leaf, foreign = pki
    decode = VllmStandIn("decode-0")
    dec = await tls_servers(decode, foreign)  # not signed by the pool's CA
    side = await tls_servers(
        Sidecar(
            SidecarSettings(
                decode_url=dec.url, mode="aggregated", decode_retry_s=0.3, tls_ca_file=str(ca)
            )
        ),
        leaf,
    )
    client_ctx = ssl.create_default_context(cafile=str(ca))
    async with httpx.AsyncClient(verify=client_ctx) as c:
        ready = await c.get(side.url + "/ready")
        r = await c.post(side.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert ready.status_code == 503 and r.status_code >= 500
    assert decode.state.received == []


async def ok_app(scope, receive, send):
    """A sidecar stand-in that is always ready."""
    if scope["type"] == "lifespan":
        await answer_lifespan(receive, send)
        return
    await send_json(send, 200, {})


@pytest.mark.parametrize("any_name", [False, True])
async def test_pod_ip_peers_need_any_name_and_still_the_pools_ca(
    tls_servers, service_named_pki, any_name
):
    ca, leaf, foreign = service_named_pki
    good_srv = await tls_servers(ok_app, leaf)
    bad_srv = await tls_servers(ok_app, foreign)
    gateway = Gateway(
        GatewaySettings(
            decode_urls=[good_srv.host_port, bad_srv.host_port],
            tls_ca_file=str(ca),
            tls_any_name=any_name,
            health_interval_s=60,
        )
    )
    gw = await tls_servers(gateway, leaf)
    healthy = {b for b in gateway.routing.backends.current if b not in gateway.routing.unhealthy}
    # The name on the certificate never matches 127.0.0.1: only any_name accepts it; a
    # certificate from another CA is refused either way.
    assert healthy == ({good_srv.host_port} if any_name else set())
    assert gw.port
