"""One request loop for the HTTP benchmarks: send completion bodies to a server with a bound
on concurrency and time each one (TTFT when streamed, tokens from the usage block).

    results = run_requests(url, bodies, concurrency=8, stream=True)

Used by lora_vs_vllm.py (throughput) and lora_routing.py (TTFT through the gateway)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Optional

import httpx


@dataclass(frozen=True)
class Result:
    ttft_s: Optional[float]  # streamed requests only
    latency_s: float
    completion_tokens: int
    backend: Optional[str] = None  # the gateway's x-pdpool-backend, when it names one


def run_requests(
    url: str, bodies: list[dict], concurrency: int, stream: bool = False, timeout_s: float = 600
) -> tuple[list[Result], float]:
    """Every body POSTed to `url`/v1/completions in order, `concurrency` at a time; the
    results (in the bodies' order) and the wall time. A non-200 answer raises."""
    return asyncio.run(_run(url, bodies, concurrency, stream, timeout_s))


async def _run(
    url: str, bodies: list[dict], concurrency: int, stream: bool, timeout_s: float
) -> tuple[list[Result], float]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def one(body: dict) -> Result:
            async with gate:
                return await (_streamed(client, url, body) if stream else _whole(client, url, body))

        started = time.perf_counter()
        results = await asyncio.gather(*(one(b) for b in bodies))
        return list(results), time.perf_counter() - started


async def _whole(client: httpx.AsyncClient, url: str, body: dict) -> Result:
    t = time.perf_counter()
    r = await client.post(f"{url}/v1/completions", json={**body, "stream": False})
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {r.text[:500]}")
    tokens = r.json()["usage"]["completion_tokens"]
    return Result(None, time.perf_counter() - t, tokens, r.headers.get("x-pdpool-backend"))


async def _streamed(client: httpx.AsyncClient, url: str, body: dict) -> Result:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t = time.perf_counter()
    ttft, tokens, chunks = None, None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:500]!r}")
        backend = r.headers.get("x-pdpool-backend")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if any(c.get("text") for c in event.get("choices") or ()):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t
    return Result(ttft, time.perf_counter() - t, chunks if tokens is None else tokens, backend)


def percentile(values: list[float], q: float) -> float:
    """The q-th quantile (0..1) by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]
