"""`--metrics-port` of the sidecar and the gateway (pdpool/metrics_listener.py, shared with
`pdpool serve`): the same server also listens there, for GET /metrics alone, with the
serving port's TLS."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time

import httpx
import pytest

from pdpool.cli import build_parser
from pdpool.ports import free_ports
from pdpool.up.topology import make_tls_files

CLI = [sys.executable, "-c", "import sys; from pdpool.cli import main; sys.exit(main())"]


def _wait(url: str, ca: ssl.SSLContext) -> httpx.Response:
    deadline = time.monotonic() + 30
    while True:
        try:
            return httpx.get(url, verify=ca, timeout=2)
        except httpx.ConnectError:
            assert time.monotonic() < deadline, f"{url} did not come up"
            time.sleep(0.2)


@pytest.mark.slow  # a gateway process
def test_gateway_metrics_port_serves_metrics_alone_over_the_same_tls(tmp_path):
    ca_file, (cert_file, key_file) = make_tls_files(str(tmp_path / "tls"))
    port, metrics_port = free_ports(2)
    keys = tmp_path / "keys"
    keys.write_text("k" * 20 + "\n")
    proc = subprocess.Popen(
        [
            *CLI,
            "gateway",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--decode-url",
            "127.0.0.1:1",
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
    ca = ssl.create_default_context(cafile=ca_file)
    serving, metrics = f"https://127.0.0.1:{port}", f"https://127.0.0.1:{metrics_port}"
    try:
        scrape = _wait(f"{metrics}/metrics", ca)
        assert scrape.status_code == 200 and "pdpool_gateway" in scrape.text
        # Generation, probes and anything else: 404 there, before the API-key check.
        body = {"prompt": "x", "max_tokens": 1}
        assert httpx.post(f"{metrics}/v1/completions", json=body, verify=ca).status_code == 404
        for path in ("/health", "/ready", "/v1/models"):
            assert httpx.get(f"{metrics}{path}", verify=ca).status_code == 404, path
        # The serving port is unchanged: /metrics, probes, and generation behind the keys.
        assert httpx.get(f"{serving}/metrics", verify=ca).status_code == 200
        assert httpx.get(f"{serving}/health", verify=ca).status_code == 503  # no sidecar
        assert httpx.post(f"{serving}/v1/completions", json=body, verify=ca).status_code == 401
        with pytest.raises(httpx.HTTPError):  # TLS alike: no plain HTTP on the metrics port
            httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).raise_for_status()
    finally:
        proc.terminate()
        proc.wait(15)


def test_sidecar_and_gateway_take_the_flag_and_default_to_none():
    parser = build_parser()
    for program in ("sidecar", "gateway"):
        args = parser.parse_args([program, "--metrics-port", "9091"])
        assert args.metrics_port == 9091
        assert parser.parse_args([program]).metrics_port is None  # serving port only


def test_the_metrics_port_must_differ_from_the_serving_port():
    done = subprocess.run(
        [*CLI, "gateway", "--port", "18123", "--metrics-port", "18123", "--decode-url", "a:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--metrics-port must differ from --port" in done.stderr
