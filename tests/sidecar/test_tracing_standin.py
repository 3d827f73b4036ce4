"""Tracing in the real sidecar against stand-in vLLM engines (tests/support/vllm_standin.py,
a labelled fake of a third party): off, a client's traceparent goes to every leg untouched
and no span is made; on, each leg carries its own span's traceparent in the client's trace.
The whole tree with real engines: test_e2e_observability.py."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from pdpool import tracing
from pdpool.otlp_receiver import OtlpReceiver
from pdpool.up.topology import pdpool_command

from tests.sidecar.test_proxy_standin import HISTORY, topology

TRACE_ID, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


def leg_traceparents(decode, prefill) -> list[str]:
    received = decode.state.received + prefill.state.received
    return [headers.get("traceparent") for _, _, headers in received]


async def cold_request(side) -> httpx.Response:
    async with httpx.AsyncClient() as c:
        return await c.post(
            side.url + "/v1/completions",
            json={"prompt": HISTORY, "max_tokens": 4},
            headers={"traceparent": TRACEPARENT},
        )


def test_tracing_off_imports_no_sdk():
    """Off (the default), the servers never load OpenTelemetry."""
    code = (
        "import sys, pdpool.tracing, pdpool.sidecar.proxy.app, pdpool.sidecar.gateway.app\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


async def test_tracing_off_passes_the_client_traceparent_untouched(servers):
    assert not tracing.enabled()
    decode, (prefill,), _sidecar, side = await topology(servers)
    r = await cold_request(side)
    assert r.status_code == 200 and r.headers["x-pdpool-path"] == "pd"
    # decode-first attempt, prefill leg, decode leg: all the client's own context.
    assert leg_traceparents(decode, prefill) == [TRACEPARENT] * 3


@pytest.fixture
def traced(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    with OtlpReceiver() as receiver:
        tracing.configure(receiver.endpoint, "pdpool-sidecar")
        try:
            yield receiver
        finally:
            tracing.shutdown()


async def test_tracing_on_gives_each_leg_its_own_span_in_the_client_trace(servers, traced):
    decode, (prefill,), _sidecar, side = await topology(servers)
    r = await cold_request(side)
    assert r.status_code == 200 and r.headers["x-pdpool-path"] == "pd"
    spans = traced.wait_for(lambda s: any(x["name"] == "sidecar" for x in s), timeout_s=10)
    by_id = {s["span_id"]: s for s in spans}
    parents = [tp.split("-")[2] for tp in leg_traceparents(decode, prefill)]
    assert all(tp.split("-")[1] == TRACE_ID for tp in leg_traceparents(decode, prefill))
    assert [by_id[p]["name"] for p in parents] == ["decode_first", "decode", "prefill_attempt"]
    (root,) = [s for s in spans if s["name"] == "sidecar"]
    assert root["parent_span_id"] == CLIENT_SPAN and root["attributes"]["pdpool.path"] == "pd"


def test_an_unknown_otlp_protocol_is_a_one_line_error():
    done = subprocess.run(
        pdpool_command(
            "sidecar",
            "--port",
            "0",
            "--decode-url",
            "http://127.0.0.1:1",
            "--otlp-traces-endpoint",
            "http://127.0.0.1:1",
        ),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "carrier-pigeon"},
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "carrier-pigeon" in done.stderr


def test_an_ejection_is_a_span_of_its_own(traced):
    from pdpool.sidecar.net.metrics import SidecarMetrics
    from pdpool.sidecar.proxy.prefill_legs import prefill_outliers
    from pdpool.sidecar.proxy.settings import SidecarSettings

    outliers = prefill_outliers(SidecarSettings(decode_url="http://127.0.0.1:1"), SidecarMetrics())
    outliers.eject("10.0.0.7:8000", "timeout")
    spans = traced.wait_for(lambda s: any(x["name"] == "ejection" for x in s), timeout_s=10)
    (ejection,) = [s for s in spans if s["name"] == "ejection"]
    assert ejection["parent_span_id"] is None
    assert ejection["attributes"] == {
        "pdpool.endpoint": "10.0.0.7:8000",
        "pdpool.reason": "timeout",
    }
