"""Reconcile cost of the pdpool operator on a real (local) kube-apiserver.

Measures:
  - latency from `create PDInferencePool` to all 7 children existing (sequential, idle),
  - a burst of N pools: time until every pool has its children and observedGeneration,
  - latency from "Deployments report ready" to the pool's phase Ready,
  - the operator process's CPU time and RSS while doing that, and idle at N pools.

  python benchmarks/operator_reconcile.py [--pools 100] [--sequential 10]

Needs the binaries of scripts/k8s/build-binaries.sh (built on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kubernetes import client  # noqa: E402

from benchmarks.proc_cpu import cpu_seconds_of  # noqa: E402
from devtools.devcluster import LocalCluster, build_binaries  # noqa: E402
from devtools.operator_kube import (  # noqa: E402
    OperatorProcess,
    Pools,
    api_client,
    install_crd,
    pool_manifest,
)

PAGE = os.sysconf("SC_PAGE_SIZE")


def proc_usage(pid: int) -> tuple[float, float]:
    """(CPU seconds so far, RSS MiB) of a process, from /proc."""
    cpu = cpu_seconds_of(f"/proc/{pid}/stat")
    rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / 2**20
    return cpu, rss


def children_count(apps, core, namespace: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for items in (
        apps.list_namespaced_deployment(namespace).items,
        core.list_namespaced_service(namespace).items,
        core.list_namespaced_config_map(namespace, label_selector="pdpool.io/pool").items,
    ):
        for obj in items:
            pool = (obj.metadata.labels or {}).get("pdpool.io/pool")
            if pool:
                counts[pool] = counts.get(pool, 0) + 1
    return counts


def wait(predicate, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(interval)
    raise TimeoutError("benchmark step timed out")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", type=int, default=100)
    parser.add_argument("--sequential", type=int, default=10)
    parser.add_argument("--idle-seconds", type=float, default=20)
    args = parser.parse_args()

    bin_dir = build_binaries(["etcd", "kube-apiserver", "kube-controller-manager"])
    work = Path(tempfile.mkdtemp(prefix="pdpool-bench-"))
    cluster = LocalCluster(work=work, bin_dir=bin_dir, with_controller_manager=False).start()
    api = api_client(cluster.server, cluster.ca_file, cluster.admin_token)
    install_crd(api)
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    op = OperatorProcess(cluster.kubeconfig, work / "operator.log").start()
    results: dict[str, float] = {}
    try:
        core.create_namespace({"metadata": {"name": "bench"}})
        pools = Pools(api, "bench")
        time.sleep(3)  # operator start-up (imports, discovery, first watch)
        cpu0, _ = proc_usage(op.proc.pid)

        def has_children(name: str) -> bool:
            return children_count(apps, core, "bench").get(name, 0) == 7

        def is_ready(name: str) -> bool:
            return (pools.get(name).get("status") or {}).get("phase") == "Ready"

        # 1. Sequential: one pool at a time on an idle operator.
        latencies = []
        for i in range(args.sequential):
            name = f"seq-{i}"
            t0 = time.monotonic()
            pools.create(pool_manifest(name))
            t1 = wait(partial(has_children, name), 60)
            latencies.append((t1 - t0) * 1000)
        results["apply_to_children_p50_ms"] = statistics.median(latencies)
        results["apply_to_children_p95_ms"] = pct(latencies, 0.95)

        # 2. Ready propagation: Deployments report ready -> pool phase Ready.
        ready_latencies = []
        for i in range(min(5, args.sequential)):
            name = f"seq-{i}"
            t0 = time.monotonic()
            for role in ("prefill", "decode", "gateway"):
                pools.mark_ready(name, role)
            t1 = wait(partial(is_ready, name), 60)
            ready_latencies.append((t1 - t0) * 1000)
        results["ready_to_status_p50_ms"] = statistics.median(ready_latencies)

        # 3. Burst: N pools at once.
        burst = [f"burst-{i}" for i in range(args.pools - args.sequential)]
        t0 = time.monotonic()
        for name in burst:
            pools.create(pool_manifest(name))
        created = time.monotonic()

        def all_done():
            counts = children_count(apps, core, "bench")
            return all(counts.get(n, 0) == 7 for n in burst)

        t1 = wait(all_done, 600, interval=0.5)

        def all_observed():
            items = pools.custom.list_namespaced_custom_object(
                "pdpool.io", "v1alpha1", "bench", "pdinferencepools"
            )["items"]
            return all((p.get("status") or {}).get("observedGeneration") == 1 for p in items)

        t2 = wait(all_observed, 300, interval=0.5)
        results["burst_pools"] = len(burst)
        results["burst_create_calls_s"] = created - t0
        results["burst_all_children_s"] = t1 - t0
        results["burst_all_status_s"] = t2 - t0
        results["burst_pools_per_s"] = len(burst) / (t1 - t0)
        cpu1, rss1 = proc_usage(op.proc.pid)
        results["operator_cpu_s_for_all_pools"] = cpu1 - cpu0
        results["operator_cpu_ms_per_pool"] = (cpu1 - cpu0) * 1000 / args.pools
        results["operator_rss_mib_at_n_pools"] = rss1

        # 4. Idle at N pools.
        time.sleep(2)
        cpu2, _ = proc_usage(op.proc.pid)
        time.sleep(args.idle_seconds)
        cpu3, rss3 = proc_usage(op.proc.pid)
        results["operator_idle_cpu_percent"] = (cpu3 - cpu2) * 100 / args.idle_seconds
        results["operator_idle_rss_mib"] = rss3
        results["pools"] = args.pools
    finally:
        op.stop()
        cluster.stop()
        api.close()
        cluster.remove()

    width = max(map(len, results))
    print(f"{'metric':<{width}}  value")
    for key, value in results.items():
        print(
            f"{key:<{width}}  {value:.1f}"
            if isinstance(value, float)
            else f"{key:<{width}}  {value}"
        )
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "operator_reconcile.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
