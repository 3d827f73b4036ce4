"""`pdpool serve --metrics-port`: the engine's metrics on a port of their own, where a
NetworkPolicy can admit scrapers without admitting them to generation."""

from __future__ import annotations

import httpx
import pytest

from devtools.engine_procs import spawned_engine
from pdpool.ports import free_port

# Starts engine processes: the full run's tier, not the fast one.
pytestmark = pytest.mark.slow

BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0, "ignore_eos": True}


def test_the_metrics_port_serves_metrics_and_nothing_else(tiny_qwen3, tmp_path):
    port = free_port()
    with spawned_engine(tiny_qwen3, tmp_path, "--metrics-port", str(port)) as eng:
        metrics = f"http://127.0.0.1:{port}"
        # The serving port serves both, as before.
        done = httpx.post(f"{eng.url}/v1/completions", json=BODY, timeout=60)
        assert done.status_code == 200
        assert "vllm:prompt_tokens_total" in httpx.get(f"{eng.url}/metrics", timeout=10).text

        scrape = httpx.get(f"{metrics}/metrics", timeout=10)
        assert scrape.status_code == 200
        assert scrape.headers["content-type"].startswith("text/plain")
        assert "vllm:num_requests_running" in scrape.text
        lines = scrape.text.splitlines()
        prompt = [ln for ln in lines if ln.startswith("vllm:prompt_tokens_total")]
        assert prompt and float(prompt[0].rsplit(" ", 1)[1]) >= 4  # this engine's, counted

        # Nothing but GET /metrics: no generation, no model list, not even probes.
        assert httpx.post(f"{metrics}/v1/completions", json=BODY, timeout=10).status_code == 404
        for path in ("/v1/models", "/health", "/ready", "/metrics/"):
            assert httpx.get(f"{metrics}{path}", timeout=10).status_code == 404, path
        assert httpx.post(f"{metrics}/metrics", timeout=10).status_code == 404
        assert httpx.get(f"{eng.url}/v1/models", timeout=10).status_code == 200
