"""Pure builders of a leaving engine pod's drain (preStop hooks), for every way a pod
leaves: a scale-down (the planner's, an HPA's or a user's), a rolling update, a deletion.

When a pod is deleted it leaves its Service's endpoints at once, so the gateway (decode)
or the sidecars (prefill) drop it at their next DNS refresh (5 s); its preStop hooks first
hold the containers for DRAIN_HOLD_S (no SIGTERM yet: requests routed meanwhile are still
served), then wait until nothing is in flight: for a decode pod the sidecar's requests (a
request between its prefill and decode legs still needs the engine), the engine's running
and queued requests and its KV leases (a prefill engine's computed blocks stay until
decode has read them). Only then does SIGTERM come, and the servers' graceful shutdown
finds nothing left to finish. terminationGracePeriodSeconds (drain_seconds) bounds the
whole."""

from __future__ import annotations

from typing import Any

from .names import DECODE, ENGINE_PORT, SIDECAR_PORT
from .spec import PoolSpec

DRAIN_HOLD_S = 15  # > the routers' DNS refresh (5 s) + a probe, with margin
# Runs in the engine and sidecar images (both have python3): hold, then poll the local
# /metrics until every watched series is 0 (or the endpoint stops answering).
# Arguments: HOLD_S LIMIT_S URL=SERIES[,SERIES...] ...; a SERIES is `name` or
# `name|label="value"` (a labelled gauge such as the KV connector's leases).
DRAIN_SCRIPT = """\
import ssl, sys, time, urllib.request
hold, limit = float(sys.argv[1]), float(sys.argv[2])
checks = [(u, [s.split("|") for s in n.split(",")]) for u, n in
          (a.split("=", 1) for a in sys.argv[3:])]
ctx = ssl._create_unverified_context()
def busy(url, series):
    try:
        text = urllib.request.urlopen(url, timeout=2, context=ctx).read().decode()
    except Exception:
        return False
    total = 0.0
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        for want in series:
            if line[:1] != "#" and name == want[0] and (len(want) == 1 or want[1] in line):
                total += float(line.rsplit(" ", 1)[1])
    return total > 0
time.sleep(hold)
end = time.time() + limit
while time.time() < end and any(busy(u, s) for u, s in checks):
    time.sleep(1)
"""
ENGINE_BUSY = "vllm:num_requests_running,vllm:num_requests_waiting"
LEASES = 'pdpool_kv_connector|stat="leases_active"'


def drain_seconds(pool: PoolSpec) -> int:
    """A leaving pod's whole grace: autoscaling's drainSeconds when the pool autoscales
    (its scale-downs are what it was tuned for), else spec.rollout.drainSeconds."""
    if pool.autoscaling is not None:
        return pool.autoscaling.drain_seconds
    return pool.rollout.drain_seconds


def _local(pool: PoolSpec, port: int) -> str:
    scheme = "https" if pool.tls_secret else "http"
    return f"{scheme}://127.0.0.1:{port}/metrics"


def _hook(pool: PoolSpec, *checks: str) -> dict[str, Any]:
    limit = max(drain_seconds(pool) - DRAIN_HOLD_S - 5, 1)
    command = ["python3", "-c", DRAIN_SCRIPT, str(DRAIN_HOLD_S), str(limit), *checks]
    return {"preStop": {"exec": {"command": command}}}


def engine_drain(pool: PoolSpec, role_name: str) -> dict[str, Any]:
    """The engine container's lifecycle: held until its pod has nothing in flight."""
    engine = ENGINE_BUSY + ("," + LEASES if pool.engine.kind == "pdpool" else "")
    checks = [f"{_local(pool, ENGINE_PORT)}={engine}"]
    if role_name == DECODE:
        checks.append(f"{_local(pool, SIDECAR_PORT)}=pdpool_sidecar_in_flight")
    return _hook(pool, *checks)


def sidecar_drain(pool: PoolSpec) -> dict[str, Any]:
    return _hook(pool, f"{_local(pool, SIDECAR_PORT)}=pdpool_sidecar_in_flight")
