"""Observability end to end on one small real topology (`pdpool up`'s processes: a prefill
engine, a decode engine, its sidecar, the gateway) with tracing on, exporting to an
OTLP/HTTP receiver in this process: a P/D request makes one trace whose spans form the
expected tree, a client's traceparent is honoured; and a real Prometheus scraping the same
topology answers every dashboard panel's query (tests/observability: skipped without the
Prometheus binary)."""

from __future__ import annotations

import secrets
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools.prometheus_run import auth, write_tenants
from pdpool.otlp_receiver import OtlpReceiver

from tests.support.e2e_helpers import cleanup, model_name, start_topology
from tests.support.prerequisites import built_by

pytestmark = pytest.mark.slow

TRACING_ENV = {
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
    "OTEL_BSP_SCHEDULE_DELAY": "100",
}


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def topo(receiver, tmp_path_factory):
    # Flow control on (a tenants file): the dashboard's per-tenant panels need it, and every
    # request here carries its tenant's key.
    tenants = write_tenants(tmp_path_factory.mktemp("tenants") / "tenants.yaml")
    t = start_topology(
        tmp_path_factory,
        prefill=1,
        decode=1,
        cache_hit_threshold=0.5,
        otlp_traces_endpoint=receiver.endpoint,
        tracing_env=TRACING_ENV,
        tenants_file=tenants,
    )
    yield t
    cleanup(t, keep_logs=False)


def model_of(topo) -> str:
    return model_name(topo.by_role("sidecar")[0].url)  # the gateway asks for a key


def completion(topo, prompt: str, headers: dict[str, str], stream: bool = False) -> httpx.Response:
    body = {
        "model": model_of(topo),
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
    }
    r = httpx.post(
        topo.gateway.url + "/v1/completions",
        json=body,
        headers={**headers, **auth()},
        timeout=120,
    )
    r.raise_for_status()
    return r


def trace_of(receiver: OtlpReceiver, trace_id: str, done: Any) -> list[dict[str, Any]]:
    spans = receiver.wait_for(lambda all_: done([s for s in all_ if s["trace_id"] == trace_id]))
    return [s for s in spans if s["trace_id"] == trace_id]


def children(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        out[s["parent_span_id"]].append(s)
    return out


def only(spans: list[dict[str, Any]], name: str) -> dict[str, Any]:
    named = [s for s in spans if s["name"] == name]
    assert len(named) == 1, (name, [s["name"] for s in spans])
    return named[0]


def engine_request(kids: dict[str, list[dict[str, Any]]], leg: dict[str, Any]) -> dict[str, Any]:
    """The engine's llm_request span under a sidecar leg's span."""
    span = only(kids[leg["span_id"]], "llm_request")
    assert span["service"] == "pdpool-engine"
    return span


def test_pd_request_makes_one_trace_with_the_expected_tree(topo, receiver):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    headers = {"traceparent": f"00-{trace_id}-{client_span}-01", "x-request-id": "traced-1"}
    r = completion(topo, "A cold prompt for the trace test " * 12, headers)
    assert r.headers["x-pdpool-path"] == "pd"

    def complete(spans):
        names = [s["name"] for s in spans]
        return names.count("llm_request") >= 3 and {"gateway", "sidecar"} <= set(names)

    spans = trace_of(receiver, trace_id, complete)
    kids = children(spans)
    # The client's span is the parent of the first span we made: the trace is the client's.
    (gateway,) = kids[client_span]
    assert gateway["name"] == "gateway" and gateway["service"] == "pdpool-gateway"
    assert gateway["attributes"]["pdpool.path"] == "pd"
    route, attempt = (
        only(kids[gateway["span_id"]], "route"),
        only(kids[gateway["span_id"]], "attempt"),
    )
    sidecar_url = topo.by_role("sidecar")[0].url.split("://")[1]
    assert route["attributes"]["pdpool.route.backend"] == sidecar_url
    assert attempt["attributes"]["pdpool.backend"] == sidecar_url
    assert attempt["attributes"]["pdpool.outcome"] == "ok"
    (sidecar,) = kids[attempt["span_id"]]
    assert sidecar["name"] == "sidecar" and sidecar["service"] == "pdpool-sidecar"
    attrs = sidecar["attributes"]
    assert attrs["pdpool.path"] == "pd" and attrs["gen_ai.request.id"] == "traced-1"
    legs = kids[sidecar["span_id"]]
    assert sorted(s["name"] for s in legs) == ["decode", "decode_first", "prefill"]

    first = only(legs, "decode_first")
    assert first["attributes"]["pdpool.decision"] == "rejected"
    rejected = engine_request(kids, first)
    assert rejected["attributes"]["pdpool.finish_reason"] == "cache_threshold"

    prefill = only(legs, "prefill")
    assert prefill["attributes"]["pdpool.outcome"] == "ok"
    assert prefill["attributes"]["pdpool.kv.blocks"] > 0
    attempt = only(kids[prefill["span_id"]], "prefill_attempt")
    assert attempt["attributes"]["pdpool.outcome"] == "ok"
    on_prefill = engine_request(kids, attempt)
    assert on_prefill["attributes"]["gen_ai.usage.completion_tokens"] == 1
    prompt_tokens = on_prefill["attributes"]["gen_ai.usage.prompt_tokens"]
    assert prompt_tokens > 50
    assert {"queue", "prefill"} <= {s["name"] for s in kids[on_prefill["span_id"]]}

    decode = only(legs, "decode")
    assert decode["attributes"]["pdpool.kv.blocks"] == prefill["attributes"]["pdpool.kv.blocks"]
    assert decode["attributes"]["pdpool.kv.lease"]
    on_decode = engine_request(kids, decode)
    da = on_decode["attributes"]
    assert da["gen_ai.usage.prompt_tokens"] == prompt_tokens
    assert da["gen_ai.usage.completion_tokens"] == 8
    assert da["pdpool.pulled_tokens"] > 0
    assert da["gen_ai.latency.time_in_queue"] >= 0
    phases = {s["name"]: s for s in kids[on_decode["span_id"]]}
    assert set(phases) == {"queue", "kv_load", "prefill", "decode"}
    assert phases["kv_load"]["attributes"]["pdpool.kv.pulled_tokens"] == da["pdpool.pulled_tokens"]
    assert phases["decode"]["attributes"]["gen_ai.usage.completion_tokens"] == 8
    # Spans nest in time: each phase within its engine request, each leg within the request.
    for phase in phases.values():
        assert on_decode["start_ns"] <= phase["start_ns"] <= phase["end_ns"]
        assert phase["end_ns"] <= on_decode["end_ns"] + 5_000_000  # clocks read apart
    for leg in legs:
        assert sidecar["start_ns"] <= leg["start_ns"] and leg["end_ns"] <= sidecar["end_ns"]


def test_without_traceparent_one_new_trace_per_request(topo, receiver):
    r = completion(
        topo,
        "Another cold prompt, no trace context " * 10,
        {"x-request-id": "untraced-1"},
        stream=True,
    )
    assert "data:" in r.text
    spans = receiver.wait_for(
        lambda all_: any(
            s["name"] == "sidecar" and s["attributes"].get("gen_ai.request.id") == "untraced-1"
            for s in all_
        )
    )
    (sidecar,) = [
        s
        for s in spans
        if s["name"] == "sidecar" and s["attributes"]["gen_ai.request.id"] == "untraced-1"
    ]
    trace = trace_of(
        receiver,
        sidecar["trace_id"],
        lambda t: (
            sum(s["name"] == "llm_request" for s in t) >= 3
            and any(s["name"] == "gateway" for s in t)
        ),
    )
    roots = [s for s in trace if s["parent_span_id"] is None]
    assert [s["name"] for s in roots] == ["gateway"]
    assert sidecar["attributes"]["pdpool.stream"] is True


def test_every_dashboard_query_has_data_in_a_real_prometheus(topo, tmp_path):
    from devtools.prometheus_run import (
        Prometheus,
        panel_queries,
        run_load,
        scrape_targets,
        shed_one,
    )

    # The script honours PDPOOL_PROMETHEUS_BIN; it returns at once when Prometheus is built.
    binary = Path(built_by("prometheus/build-prometheus.sh", timeout_s=1800))
    prom = Prometheus(binary, tmp_path / "prometheus", scrape_targets(topo))
    try:
        prom.wait_ready()
        prom.wait_targets_up(len(topo.children))
        run_load(topo.gateway.url, model_of(topo), per_worker=4)
        assert shed_one(topo.gateway.url, model_of(topo)) == 429
        time.sleep(3)  # a few scrapes after the load
        missing = []
        for title, legend, expr in panel_queries():
            if not prom.query(expr):
                missing.append(f"{title} / {legend}: {expr}")
        assert not missing, "queries without data:\n" + "\n".join(missing)
    finally:
        prom.stop()
