"""Prometheus metrics of one engine, on a registry of its own (several engines may share a
process in tests)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineMetrics:
    def __init__(self, engine, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        sched, pool = engine.scheduler, engine.kv.pool

        def gauge(name: str, doc: str, fn) -> None:
            g = Gauge(name, doc, list(labels), registry=r)
            g.labels(**labels).set_function(fn)

        gauge("pdpool_num_requests_running", "Requests being computed.", lambda: len(sched.running))
        gauge("pdpool_num_requests_waiting", "Requests waiting to be scheduled.",
              lambda: len(sched.waiting))
        gauge("pdpool_kv_blocks_used", "KV blocks in use.", lambda: pool.num_used_blocks)
        gauge("pdpool_kv_blocks_total", "KV blocks in the pool.", lambda: pool.num_blocks)
        gauge("pdpool_kv_cache_usage_perc", "Fraction of KV blocks in use.", pool.usage)
        self._labels = labels

        def counter(name: str, doc: str, extra=()):
            return Counter(name, doc, list(labels) + list(extra), registry=r)

        self.prompt_tokens = counter("pdpool_prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("pdpool_generation_tokens", "Tokens generated.")
        self.requests_finished = counter("pdpool_request_success", "Finished requests.",
                                         ["finished_reason"])
        self.labels = labels
        self.client_disconnects = counter(
            "pdpool_client_disconnects", "Clients that went away before their answer was "
            "complete, by phase: body (while sending it), waiting (preparing, queued or "
            "prefilling: aborted before any token), running (generating).", ["phase"])
        self.ttft = Histogram("pdpool_time_to_first_token_seconds", "Time to first token.",
                              list(labels), buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdpool_inter_token_latency_seconds", "Time between tokens.",
                             list(labels), buckets=_LATENCY_BUCKETS, registry=r)
        # Counters that the engine keeps itself are exported by reading them at scrape time.
        gauge("pdpool_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
              lambda: pool.queries)
        gauge("pdpool_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
              lambda: pool.hits)
        gauge("pdpool_num_preemptions_total", "Requests preempted.",
              lambda: sched.num_preemptions)
        rej = Gauge("pdpool_cache_threshold_rejections_total",
                    "Requests rejected below their cache-hit threshold.",
                    list(labels) + ["threshold_source"], registry=r)
        for source in ("request", "global"):
            rej.labels(threshold_source=source, **labels).set_function(
                lambda s=source: sched.num_threshold_rejections[s])
        kv_stat = Gauge("pdpool_kv_connector", "KV connector counters (bytes_read, "
                        "tokens_pulled, loads_ok, loads_failed, leases_active, ...).",
                        list(labels) + ["stat"], registry=r)
        for stat in engine.connector.stats():
            kv_stat.labels(stat=stat, **labels).set_function(
                lambda s=stat: engine.connector.stats()[s])
        gauge("pdpool_requests_aborted_total", "Requests aborted (client gone, cancelled).",
              lambda: engine.stats["aborted"])
        gauge("pdpool_requests_failed_total", "Requests ended by an error of their own "
              "(sampling, output processing, the model forward), the others unharmed.",
              lambda: engine.stats["failed"])
        gauge("pdpool_engine_fault", "1 while the model forward fails for every request "
              "(an engine-wide failure; /health answers 503).",
              lambda: 0 if engine.fault is None else 1)
        gauge("pdpool_computed_tokens_total", "Tokens run through the model.",
              lambda: engine.stats["computed_tokens"])
        by_source = Gauge("pdpool_prompt_tokens_by_source_total",
                          "Prompt tokens by where their KV came from: this engine's prefix "
                          "cache (local), a peer (pulled, verified), the model (computed).",
                          list(labels) + ["source"], registry=r)
        for source in ("local", "pulled", "computed"):
            by_source.labels(source=source, **labels).set_function(
                lambda s=source: engine.stats[f"prompt_tokens_{s}"])

    def observe_output(self, out, first: bool, since: float) -> None:
        lab = self._labels
        if first:
            self.ttft.labels(**lab).observe(since)
        else:
            self.itl.labels(**lab).observe(since)
        if out.finished:
            self.prompt_tokens.labels(**lab).inc(out.num_prompt_tokens)
            self.generation_tokens.labels(**lab).inc(out.num_output_tokens)
            self.requests_finished.labels(finished_reason=out.finish_reason or "unknown",
                                          **lab).inc()
