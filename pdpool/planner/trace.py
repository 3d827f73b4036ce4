"""Recorded planner inputs: each scrape a live planner made (only the series the planner
reads) and the replicas it saw, one JSON line per tick, gzip-compressed. A recording of a
real run replays through plan() in tests, as the traces the planner's decisions are
checked on.

    {"at": 12.5, "replicas": {"prefill": 1, "decode": 2},
     "endpoints": [{"role": "decode", "endpoint": "decode-0",
                    "samples": {"vllm:num_requests_running": [[{"model_name": "m"}, 3.0]]}}]}
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .metrics import EndpointMetrics, Snapshot

# The families the planner reads (signals.py); _sum, _count and _created are left out.
PLANNER_FAMILIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket",
    "pdpool_sidecar_prefill_leg_seconds_bucket",
    "pdpool_sidecar_ttft_seconds_bucket",
    "pdpool_sidecar_phase_seconds_bucket",
    "pdpool_sidecar_prefill_attempts",
    "pdpool_sidecar_legs",
    "pdpool_sidecar_threshold_rejections",
)


def _kept(name: str) -> bool:
    return any(name in (family, family + "_total") for family in PLANNER_FAMILIES)


@dataclass(frozen=True)
class Tick:
    snapshot: Snapshot
    replicas: dict[str, int]  # per role: serving and starting, as the planner counted them


def tick_to_json(snapshot: Snapshot, replicas: dict[str, int]) -> dict[str, Any]:
    return {
        "at": round(snapshot.at, 3),
        "replicas": replicas,
        "endpoints": [
            {
                "role": e.role,
                "endpoint": e.endpoint,
                "samples": {
                    name: [[dict(labels), value] for labels, value in series.items()]
                    for name, series in e.samples.items()
                    if _kept(name)
                },
            }
            for e in snapshot.endpoints
        ],
    }


def tick_from_json(d: dict[str, Any]) -> Tick:
    endpoints = tuple(
        EndpointMetrics(
            e["role"],
            e["endpoint"],
            {
                name: {tuple(sorted(labels.items())): float(value) for labels, value in series}
                for name, series in e["samples"].items()
            },
        )
        for e in d["endpoints"]
    )
    return Tick(Snapshot(float(d["at"]), endpoints), dict(d["replicas"]))


class TraceWriter:
    """Appends ticks to PATH (gzip, one JSON line each), flushed per tick so a run that is
    killed still leaves a readable recording."""

    def __init__(self, path: str) -> None:
        # Open across ticks until close(): a context manager per write would end the stream.
        self._fh = gzip.GzipFile(Path(path), "wb")

    def write(self, snapshot: Snapshot, replicas: dict[str, int]) -> None:
        line = json.dumps(tick_to_json(snapshot, replicas), separators=(",", ":")) + "\n"
        self._fh.write(line.encode())
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_trace(path: str | Path) -> Iterator[Tick]:
    """The ticks of a recording; one cut short (its writer killed) ends at its last whole
    line."""
    with gzip.open(Path(path), "rt", encoding="utf-8") as fh:
        try:
            for line in fh:
                if line.endswith("\n"):
                    yield tick_from_json(json.loads(line))
        except EOFError:
            return
