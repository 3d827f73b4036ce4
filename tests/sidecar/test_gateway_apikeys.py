"""Gateway API keys: 401 without a valid key, probes and metrics stay open, the key is not
forwarded, a rotated key file takes effect without a restart."""

from __future__ import annotations

import time

import httpx
import pytest

from pdpool.ports import free_port
from pdpool.sidecar.net.apikeys import ApiKeyError, ApiKeys, parse_keys, presented_key
from pdpool.sidecar.gateway.app import Gateway, GatewaySettings
from pdpool.sidecar.proxy.app import Sidecar
from pdpool.sidecar.proxy.settings import SidecarSettings
from pdpool.up.topology import make_tls_files

from tests.support.vllm_standin import VllmStandIn

KEY_A, KEY_B = "a" * 8 + "-team-a-0123456789", "b" * 8 + "-team-b-0123456789"


def test_key_file_parsing_and_headers():
    assert len(parse_keys(f"# comment\n\n{KEY_A}\n  {KEY_B}  \n")) == 2
    with pytest.raises(ApiKeyError, match="shorter"):
        parse_keys("short\n")
    with pytest.raises(ApiKeyError, match="no API key"):
        parse_keys("# nothing\n")
    assert presented_key({"authorization": f"Bearer {KEY_A}"}) == KEY_A
    assert presented_key({"authorization": f"bearer  {KEY_A} "}) == KEY_A
    assert presented_key({"x-api-key": KEY_B}) == KEY_B
    assert presented_key({"authorization": "Basic abc"}) is None


def test_rotation_keeps_last_good_keys_on_a_broken_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text(KEY_A + "\n")
    keys = ApiKeys(str(path), recheck_s=0, settle_s=0)
    assert keys.allows(KEY_A) and not keys.allows(KEY_B) and not keys.allows(None)
    path.write_text(KEY_B + "\n")
    keys.allows(KEY_B)  # new content is taken once it reads the same twice
    assert keys.allows(KEY_B) and not keys.allows(KEY_A)
    path.write_text("")  # emptied by mistake: the door stays as it was
    assert keys.allows(KEY_B) and keys.allows(KEY_B) and keys.allows(KEY_B)


async def test_gateway_asks_for_a_key_and_does_not_forward_it(servers, tmp_path):
    engine = VllmStandIn("decode-0")
    e = await servers(engine)
    side = await servers(Sidecar(SidecarSettings(decode_url=e.url, mode="aggregated")))
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A}\n{KEY_B}\n")
    gw = await servers(
        Gateway(GatewaySettings(decode_urls=[side.host_port], api_keys_file=str(path)))
    )
    body = {"prompt": "hello " * 10, "max_tokens": 2}
    async with httpx.AsyncClient() as c:
        none = await c.post(gw.url + "/v1/completions", json=body)
        wrong = await c.post(
            gw.url + "/v1/completions", json=body, headers={"authorization": "Bearer " + "x" * 30}
        )
        models = await c.get(gw.url + "/v1/models")
        ok = await c.post(
            gw.url + "/v1/completions", json=body, headers={"authorization": f"Bearer {KEY_A}"}
        )
        ok_b = await c.post(gw.url + "/v1/completions", json=body, headers={"x-api-key": KEY_B})
        probes = [(await c.get(gw.url + p)).status_code for p in ("/health", "/ready", "/metrics")]
    assert none.status_code == wrong.status_code == models.status_code == 401
    assert none.headers["www-authenticate"] == "Bearer"
    assert none.json()["error"]["code"] == "invalid_api_key"
    assert ok.status_code == ok_b.status_code == 200
    assert probes == [200, 200, 200]
    assert len(engine.state.received) == 2  # refused requests never reached an engine
    for _, _, headers in engine.state.received:
        lowered = {k.lower() for k in headers}
        assert "authorization" not in lowered and "x-api-key" not in lowered


async def test_gateway_without_a_key_file_is_open(servers):
    engine = VllmStandIn("decode-0")
    e = await servers(engine)
    side = await servers(Sidecar(SidecarSettings(decode_url=e.url, mode="aggregated")))
    gw = await servers(Gateway(GatewaySettings(decode_urls=[side.host_port])))
    async with httpx.AsyncClient() as c:
        r = await c.post(gw.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200


@pytest.mark.slow  # a gateway process
def test_gateway_serves_https_with_the_given_certificate(tmp_path):
    """`pdpool gateway --tls-cert-file/--tls-key-file`: HTTPS that verifies against the CA;
    plain HTTP on that port gets nowhere; one flag without the other is refused."""
    import subprocess
    import sys

    ca_file, (cert_file, key_file) = make_tls_files(str(tmp_path / "tls"))
    port = free_port()
    keys = tmp_path / "keys"
    keys.write_text(KEY_A + "\n")
    cli = [
        sys.executable,
        "-c",
        "import sys; from pdpool.cli import main; sys.exit(main())",
        "gateway",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--decode-url",
        "127.0.0.1:1",
    ]
    half = subprocess.run(
        [*cli, "--tls-cert-file", cert_file],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert half.returncode != 0 and "go together" in half.stderr
    proc = subprocess.Popen(
        [
            *cli,
            "--tls-cert-file",
            cert_file,
            "--tls-key-file",
            key_file,
            "--api-keys-file",
            str(keys),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import ssl

    ca = ssl.create_default_context(cafile=ca_file)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.get(f"https://127.0.0.1:{port}/health", verify=ca, timeout=2)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, "gateway did not come up"
                time.sleep(0.2)
        assert r.status_code == 503  # served over TLS (no sidecar behind it here)
        unauth = httpx.post(
            f"https://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}, verify=ca
        )
        assert unauth.status_code == 401
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).raise_for_status()
        with pytest.raises(httpx.ConnectError):  # a certificate not from this CA
            httpx.get(f"https://127.0.0.1:{port}/health", timeout=2)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
