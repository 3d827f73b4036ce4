"""Prometheus metrics of one engine, on a registry of its own (several engines may share a
process in tests)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from pdpool.engine.engine_state import EngineView
from pdpool.engine.outputs import RequestOutput, RequestPhases
from pdpool.engine.server.priority_metrics import PriorityMetrics

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# vLLM's own series (vllm/v1/metrics/loggers.py and buckets.py of vLLM 0.32), beside ours, so
# that vLLM dashboards and routers that scrape vLLM (llm-d's endpoint picker) work unchanged:
# same names, types, label names (model_name, engine) and histogram buckets.
VLLM_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
VLLM_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
VLLM_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# name -> type, as vLLM 0.32 exposes them (counters add _total); tests check both engines.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}


class _VllmCounters:
    """Counters the engine keeps itself, exported as counters (not gauges) at scrape time."""

    def __init__(self, view: EngineView, labels: dict[str, str]) -> None:
        self.view, self.labels = view, labels

    def collect(self) -> Iterator[CounterMetricFamily]:
        state = self.view.state()
        for name, doc, value in (
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                state.prefix_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                state.prefix_hits,
            ),
            (
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                state.preemptions,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), value)
            yield family


class EngineMetrics:
    def __init__(self, view: EngineView, model_name: str) -> None:
        """`view`: the engine's facts and state (engine_state.LiveEngineView or the mirror
        of an engine process); every gauge reads its state at scrape time."""
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        state = view.state

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            g = Gauge(name, doc, list(labels), registry=r)
            g.labels(**labels).set_function(fn)

        gauge("pdpool_num_requests_running", "Requests being computed.", lambda: state().running)
        gauge(
            "pdpool_num_requests_waiting",
            "Requests waiting to be scheduled.",
            lambda: state().waiting,
        )
        gauge("pdpool_kv_blocks_used", "KV blocks in use.", lambda: state().blocks_used)
        gauge("pdpool_kv_blocks_total", "KV blocks in the pool.", lambda: state().blocks_total)
        gauge("pdpool_kv_cache_usage_perc", "Fraction of KV blocks in use.", lambda: state().usage)
        self._labels = labels

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
            return Counter(name, doc, list(labels) + list(extra), registry=r)

        self.prompt_tokens = counter("pdpool_prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("pdpool_generation_tokens", "Tokens generated.")
        self.requests_finished = counter(
            "pdpool_request_success", "Finished requests.", ["finished_reason"]
        )
        self.labels = labels
        self.client_disconnects = counter(
            "pdpool_client_disconnects",
            "Clients that went away before their answer was "
            "complete, by phase: body (while sending it), waiting (preparing, queued or "
            "prefilling: aborted before any token), running (generating).",
            ["phase"],
        )
        self.ttft = Histogram(
            "pdpool_time_to_first_token_seconds",
            "Time to first token.",
            list(labels),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdpool_inter_token_latency_seconds",
            "Time between tokens.",
            list(labels),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # Observed for every token: look the labelled series up once.
        self._ttft_series = self.ttft.labels(**labels)
        self._itl_series = self.itl.labels(**labels)
        self._vllm_series(view, model_name)
        self.by_priority = PriorityMetrics(r, view, labels)
        # Counters that the engine keeps itself are exported by reading them at scrape time.
        gauge(
            "pdpool_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
            lambda: state().prefix_queries,
        )
        gauge(
            "pdpool_prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache.",
            lambda: state().prefix_hits,
        )
        gauge("pdpool_num_preemptions_total", "Requests preempted.", lambda: state().preemptions)
        rej = Gauge(
            "pdpool_cache_threshold_rejections_total",
            "Requests rejected below their cache-hit threshold.",
            [*labels, "threshold_source"],
            registry=r,
        )

        def rejections(source: str) -> float:
            return state().threshold_rejections[source]

        for source in ("request", "global"):
            rej.labels(threshold_source=source, **labels).set_function(
                functools.partial(rejections, source)
            )
        kv_stat = Gauge(
            "pdpool_kv_connector",
            "KV connector counters (bytes_read, "
            "tokens_pulled, loads_ok, loads_failed, leases_active, ...).",
            [*labels, "stat"],
            registry=r,
        )

        def connector_stat(stat: str) -> float:
            return state().connector[stat]

        for stat in state().connector:
            kv_stat.labels(stat=stat, **labels).set_function(
                functools.partial(connector_stat, stat)
            )
        _offload_series(r, labels, state)
        gauge(
            "pdpool_requests_aborted_total",
            "Requests aborted (client gone, cancelled).",
            lambda: state().stats["aborted"],
        )
        gauge(
            "pdpool_requests_failed_total",
            "Requests ended by an error of their own "
            "(sampling, output processing, the model forward), the others unharmed.",
            lambda: state().stats["failed"],
        )
        gauge(
            "pdpool_engine_fault",
            "1 while the model forward fails for every request "
            "(an engine-wide failure; /health answers 503).",
            lambda: 0 if state().fault is None else 1,
        )
        gauge(
            "pdpool_computed_tokens_total",
            "Tokens run through the model.",
            lambda: state().stats["computed_tokens"],
        )
        by_source = Gauge(
            "pdpool_prompt_tokens_by_source_total",
            "Prompt tokens by where their KV came from: this engine's prefix "
            "cache (local), a peer (pulled, verified), the model (computed).",
            [*labels, "source"],
            registry=r,
        )

        def prompt_tokens_from(source: str) -> float:
            return state().stats[f"prompt_tokens_{source}"]

        for source in ("local", "pulled", "computed"):
            by_source.labels(source=source, **labels).set_function(
                functools.partial(prompt_tokens_from, source)
            )

    def _vllm_series(self, view: EngineView, model_name: str) -> None:
        r, state = self.registry, view.state
        vl = self.vllm_labels = {"model_name": model_name, "engine": "0"}
        names = list(vl)

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            Gauge(name, doc, names, registry=r, multiprocess_mode="mostrecent").labels(
                **vl
            ).set_function(fn)

        gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            lambda: state().running,
        )
        gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            lambda: state().waiting,
        )
        gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            lambda: state().usage,
        )
        cfg = view.config
        info = {
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(bool(cfg.enable_prefix_caching)),
            "num_gpu_blocks": str(state().blocks_total),
            "num_cpu_blocks": "None",
            "engine": "0",
        }
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(info),
            registry=r,
            multiprocess_mode="mostrecent",
        ).labels(**info).set(1)
        r.register(_VllmCounters(view, vl))
        r.register(_VllmOffloadCounters(state, vl))
        if cfg.enable_lora:
            from pdpool.engine.server.lora_metrics import LoRARequestsInfo

            r.register(LoRARequestsInfo(view))
        self.vllm_prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", names, registry=r
        ).labels(**vl)
        self.vllm_generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", names, registry=r
        ).labels(**vl)
        self.vllm_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=r,
        )
        for reason in VLLM_FINISH_REASONS:
            self.vllm_success.labels(finished_reason=reason, **vl)
        self.vllm_ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            names,
            buckets=VLLM_TTFT_BUCKETS,
            registry=r,
        ).labels(**vl)
        self.vllm_itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            names,
            buckets=VLLM_ITL_BUCKETS,
            registry=r,
        ).labels(**vl)
        self.vllm_e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            names,
            buckets=VLLM_E2E_BUCKETS,
            registry=r,
        ).labels(**vl)

        def phase(name: str, doc: str, buckets: Sequence[float] = VLLM_E2E_BUCKETS) -> Any:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**vl)

        # vLLM's request phases (same names and buckets), and the KV load vLLM lacks: a
        # P/D request's TTFT split in the engine (queue, KV pulled from a peer, prefill).
        self.vllm_queue = phase(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
        )
        self.vllm_prefill = phase(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
        )
        self.vllm_decode = phase(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
        )
        self.kv_load = phase(
            "pdpool_kv_load_seconds",
            "Time a request waited for its KV to arrive from a peer (admitted until running).",
            _LATENCY_BUCKETS,
        )
        # Called with every finished output and its e2e time (request_spans.py, when
        # tracing is on).
        self.on_finished: Optional[Callable[[RequestOutput, Optional[float]], None]] = None

    def _observe_phases(self, out: RequestOutput, phases: RequestPhases) -> None:
        if phases.admitted is not None:
            self.vllm_queue.observe(phases.admitted - phases.arrived)
        if phases.running is not None and phases.first_token is not None:
            self.vllm_prefill.observe(phases.first_token - phases.running)
            if out.num_pulled_tokens and phases.admitted is not None:
                self.kv_load.observe(phases.running - phases.admitted)
        if phases.first_token is not None:
            self.vllm_decode.observe(max(out.produced_at - phases.first_token, 0.0))

    def observe_output(
        self,
        out: RequestOutput,
        first: bool,
        since: float,
        e2e: float | None = None,
        priority: int = 0,
    ) -> None:
        lab = self._labels
        self.by_priority.observe(out, priority, first, since)
        if first:
            self._ttft_series.observe(since)
            self.vllm_ttft.observe(since)
        else:
            self._itl_series.observe(since)
            self.vllm_itl.observe(since)
        if out.finished:
            self.prompt_tokens.labels(**lab).inc(out.num_prompt_tokens)
            self.generation_tokens.labels(**lab).inc(out.num_output_tokens)
            self.requests_finished.labels(
                finished_reason=out.finish_reason or "unknown", **lab
            ).inc()
            self.vllm_prompt_tokens.inc(out.num_prompt_tokens)
            self.vllm_generation_tokens.inc(out.num_output_tokens)
            self.vllm_success.labels(
                finished_reason=out.finish_reason or "abort", **self.vllm_labels
            ).inc()
            if e2e is not None:
                self.vllm_e2e.observe(e2e)
            if out.phases is not None:
                self._observe_phases(out, out.phases)
            if self.on_finished is not None:
                self.on_finished(out, e2e)

    def client_disconnected(self, phase: str) -> None:
        """Counts a client that went away: phase is body, waiting or running."""
        self.client_disconnects.labels(phase=phase, **self.labels).inc()


# vLLM's offloading connector's counters (kv_connector/v1/offloading/metrics.py), from the
# tier's stats: load and store bytes and seconds, and stores it had no room for.
VLLM_OFFLOAD_COUNTERS = (
    ("vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage.", "load_bytes"),
    (
        "vllm:kv_offload_load_time",
        "Total load time from offload storage, in seconds.",
        "load_seconds",
    ),
    ("vllm:kv_offload_store_bytes", "Total bytes stored to offload storage.", "store_bytes"),
    (
        "vllm:kv_offload_store_time",
        "Total store time to offload storage, in seconds.",
        "store_seconds",
    ),
    (
        "vllm:kv_offload_allocation_failure",
        "Number of KV offload store allocation attempts that failed.",
        "saves_dropped",
    ),
)


class _VllmOffloadCounters:
    """The tier's stats under vLLM's offload metric names, as counters (none without a
    tier)."""

    def __init__(self, state: Callable[[], Any], labels: dict[str, str]) -> None:
        self.state, self.labels = state, labels

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.state().offload
        if not stats:
            return
        for name, doc, stat in VLLM_OFFLOAD_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), float(stats.get(stat, 0.0)))
            yield family


def _offload_series(r: CollectorRegistry, labels: dict[str, str], state: Callable[[], Any]) -> None:
    """The KV offload tier's counters, one series per stat (none without a tier)."""
    tier_stat = Gauge(
        "pdpool_kv_offload",
        "KV offload tier counters: hit_tokens (prefix tokens found in the tier), "
        "loaded_tokens, load_bytes, load_seconds (sum of read latencies), loads_ok, "
        "loads_failed, records_rejected (failed their check: recomputed), stores, "
        "store_bytes, store_failures, evictions, bytes_used, capacity_bytes, ...",
        [*labels, "stat"],
        registry=r,
    )

    def offload_stat(stat: str) -> float:
        return float(state().offload.get(stat, 0.0))

    for stat in state().offload:
        tier_stat.labels(stat=stat, **labels).set_function(functools.partial(offload_stat, stat))
