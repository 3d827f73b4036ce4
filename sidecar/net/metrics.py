"""Prometheus metrics of the sidecar and the gateway.

Each app owns a registry, so several apps can live in one process (tests, `pdpool up`
in-process tools) without clashing on the global registry."""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import GaugeMetricFamily

__all__ = ["CONTENT_TYPE_LATEST", "GatewayMetrics", "SidecarMetrics"]

M = TypeVar("M", Counter, Gauge, Histogram)
# Phases of a request, from a few ms (a decode-first rejection) to a long prefill.
PHASE_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip


class Children(Generic[M]):
    """A labelled metric's children, each looked up once: prometheus_client's labels()
    checks the values and takes a lock on every call, and the hot path asks for the same
    few children on every request."""

    def __init__(self, metric: M) -> None:
        self._metric: M = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class KVBlocksCollector:
    """A gauge read at scrape time: the blocks a KV index knows each engine holds (from
    that engine's events). It shows whether a router is fed, and how far it has got."""

    def __init__(
        self, name: str, documentation: str, label: str, counts: Callable[[], dict[str, int]]
    ) -> None:
        self.name, self.documentation, self.label = name, documentation, label
        self.counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=[self.label])
        for engine, n in sorted(self.counts().items()):
            family.add_metric([engine], n)
        yield family


def bodies_busy_counter(name: str, registry: CollectorRegistry) -> Counter:
    return Counter(
        name,
        "Requests refused with 503: their body would take the process past its budget of "
        "large bodies in flight",
        registry=registry,
    )


class SidecarMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # path: decode (served by decode alone), pd (remote prefill then decode),
        # fallback (decode prefilled itself: no prefill engine could serve),
        # aggregated, client_error, upstream_error, cancelled, bodies_busy.
        self.requests = Counter(
            "pdpool_sidecar_requests", "Requests by path taken", ["mode", "path"], registry=r
        )
        # The gateway's up-front path (x-pdpool-kv-path): pd honoured; decode correct or
        # mispredicted (the engine rejected after all).
        self.kv_path_hints = Counter(
            "pdpool_sidecar_kv_path_hints",
            "Gateway path hints from KV events, by outcome",
            ["hint", "outcome"],
            registry=r,
        )
        self.legs = Counter("pdpool_sidecar_legs", "Upstream legs sent", ["leg"], registry=r)
        # by: kv (the prefill engines' KV events), load (in-flight legs), named (the
        # request's own x-prefiller-host-port).
        self.prefill_ranking = Counter(
            "pdpool_sidecar_prefill_ranking",
            "How prefill engines were ordered for a leg",
            ["by"],
            registry=r,
        )
        self.rejections = Counter(
            "pdpool_sidecar_threshold_rejections",
            "Decode-first attempts rejected by the cache-hit threshold",
            registry=r,
        )
        self.prefill_attempts = Counter(
            "pdpool_sidecar_prefill_attempts",
            "Prefill leg attempts by outcome",
            ["outcome"],
            registry=r,
        )
        # A prefill leg for a LoRA adapter (adapter_legs.py): resident (a prefill engine
        # lists it), loaded (the sidecar loaded it on one), decode_only (neither: decode
        # served alone).
        self.adapter_prefill = Children(
            Counter(
                "pdpool_sidecar_adapter_prefill",
                "Prefill legs of adapter requests, by how the adapter was found",
                ["outcome"],
                registry=r,
            )
        )
        # Prefill engines left out of a leg because their KV fingerprint (model revision,
        # dtype, block size, layout) differs from the decode engine's: a rollout's
        # mixed-revision handoffs avoided (revision_legs.py).
        self.other_revision_skipped = Counter(
            "pdpool_sidecar_prefill_other_revision_skipped",
            "Prefill engines skipped for a KV fingerprint other than the decode engine's",
            registry=r,
        )
        self.forbidden_targets = Counter(
            "pdpool_sidecar_forbidden_prefill_targets",
            "x-prefiller-host-port outside the prefill set",
            registry=r,
        )
        self.client_kv_dropped = Counter(
            "pdpool_sidecar_client_kv_params_dropped",
            "Client-supplied kv_transfer_params removed",
            registry=r,
        )
        self.bodies_busy = bodies_busy_counter("pdpool_sidecar_bodies_busy", r)
        self.pull_offered_tokens = Counter(
            "pdpool_sidecar_pull_offered_tokens",
            "Decode-cached prefix tokens offered to prefill",
            registry=r,
        )
        self.computed_tokens = Counter(
            "pdpool_sidecar_computed_prompt_tokens",
            "Prompt tokens computed, by leg",
            ["leg"],
            registry=r,
        )
        self.decode_retries = Counter(
            "pdpool_sidecar_decode_retries",
            "Decode legs retried after a connection failure",
            registry=r,
        )
        self.in_flight = Gauge("pdpool_sidecar_in_flight", "Requests in flight", registry=r)
        self.prefill_ejections = Counter(
            "pdpool_sidecar_prefill_ejections",
            "Prefill engines ejected by outlier detection",
            ["endpoint", "reason"],
            registry=r,
        )
        self.prefill_ejected = Gauge(
            "pdpool_sidecar_prefill_ejected",
            "1 while the prefill engine is ejected",
            ["endpoint"],
            registry=r,
        )
        self.engine_rejects = Gauge(
            "pdpool_sidecar_engine_rejects",
            "1 when the decode engine honours cache_hit_threshold, "
            "0 when not (decode-first decides by length), -1 unknown",
            registry=r,
        )
        self.length_decisions = Counter(
            "pdpool_sidecar_length_decisions",
            "decode-first with an engine that cannot reject: decided by prompt length",
            ["decision"],
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "pdpool_sidecar_prefill_leg_seconds", "Duration of successful prefill legs", registry=r
        )
        # TTFT split without tracing: a P/D request's time to first token is about
        # rejection + prefill + decode_first_token; the engines split further (their
        # vllm:request_queue_time_seconds and pdpool_kv_load_seconds).
        self.phase_seconds = Histogram(
            "pdpool_sidecar_phase_seconds",
            "Phases of a request: rejection (decode-first attempt until decode refused it), "
            "prefill (the remote prefill leg, every attempt), decode_first_token (the "
            "decode leg of a stream until its first bytes: KV transfer and first decode step)",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "pdpool_sidecar_ttft_seconds",
            "Streamed requests: read until the answer's first bytes went to the client, by path",
            ["path"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        # The children counted on every request.
        self.requests_by = Children(self.requests)
        self.legs_by = Children(self.legs)
        self.length_decisions_by = Children(self.length_decisions)
        self.phase = Children(self.phase_seconds)
        self.ttft_by = Children(self.ttft_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdpool_gateway_requests",
            "Requests by backend and status",
            ["backend", "status"],
            registry=r,
        )
        self.affinity = Counter(
            "pdpool_gateway_affinity",
            "Routing decisions: preferred (prefix owner) or spilled",
            ["decision"],
            registry=r,
        )
        # LoRA residency of the engine chosen for an adapter's request (lora_affinity.py).
        self.lora_routes = Counter(
            "pdpool_gateway_lora_routes",
            "Adapter requests by the chosen engine's residency: running, recent, free, "
            "unknown, waiting or full",
            ["residency"],
            registry=r,
        )
        # precise (KV events; path pd or decode) or affinity (no engine known).
        self.kv_routes = Counter(
            "pdpool_gateway_kv_routes",
            "Routing decisions from KV events, by path",
            ["mode", "path"],
            registry=r,
        )
        self.kv_engine_tokenize = Counter(
            "pdpool_gateway_kv_engine_tokenize",
            "Prompts tokenized by a decode engine's /tokenize for routing, by result",
            ["result"],
            registry=r,
        )
        self.kv_predicted_hit_ratio = Histogram(
            "pdpool_gateway_kv_predicted_hit_ratio",
            "Predicted prefix hit ratio of the chosen engine",
            buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9, 1),
            registry=r,
        )
        self.retries = Counter(
            "pdpool_gateway_retries", "Requests retried on another backend", registry=r
        )
        self.bodies_busy = bodies_busy_counter("pdpool_gateway_bodies_busy", r)
        self.healthy = Gauge(
            "pdpool_gateway_backend_healthy",
            "1 when the backend is healthy",
            ["backend"],
            registry=r,
        )
        self.in_flight = Gauge(
            "pdpool_gateway_in_flight", "Requests in flight per backend", ["backend"], registry=r
        )
        self.ejections = Counter(
            "pdpool_gateway_ejections",
            "Decode sidecars ejected by outlier detection",
            ["backend", "reason"],
            registry=r,
        )
        self.ejected = Gauge(
            "pdpool_gateway_backend_ejected",
            "1 while the backend is ejected",
            ["backend"],
            registry=r,
        )
        self.phase_seconds = Histogram(
            "pdpool_gateway_phase_seconds",
            "Phases of a request in the gateway: route (the routing decision, KV index "
            "and tokenization included)",
            ["phase"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "pdpool_gateway_ttft_seconds",
            "Streamed requests: read until the answer's first bytes went to the client, by "
            "the P/D path the sidecar took (decode, pd, fallback, aggregated)",
            ["path"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.phase = Children(self.phase_seconds)
        self.ttft_by = Children(self.ttft_seconds)
        # outcome: ok (the stream went on elsewhere), failed (no path could continue it).
        self.migrations = Counter(
            "pdpool_gateway_migrations",
            "Streams continued on another backend after a failure",
            ["outcome"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
