"""What the front door adds per request: Envoy + `pdpool epp` against `pdpool gateway`, in
front of the same sidecars and engines, requests alternating between the two.

    python benchmarks/envoy_overhead.py [--requests 100] [--max-tokens 4]

One `pdpool up --gateway envoy --kv-events --prefill 0 --decode 2` (tiny model), plus a
`pdpool gateway` started with the picker's own routing flags on another port. Requests are
sent one at a time (no queueing: the front door's own time, not a burst's), alternating
between the two doors, each a short streamed completion of a prompt its engine already
holds. Reported: TTFT and total time p50/p99 for each door and their difference, and the
picker's own time per request (pdpool_epp_decision_seconds). Prints a table and writes
benchmarks/results/<--out>.json. Needs scripts/envoy/install.sh.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import print_table, write_json
from pdpool.command_lines import gateway_argv
from pdpool.ports import free_port
from pdpool.up.topology import SIDE_BY_SIDE, Topology, TopologySpec, ensure_tiny_model, healthy
from routing import epp_decision_ms


def timed(client: httpx.Client, url: str, body: dict) -> tuple[float, float]:
    """(TTFT, total) of one streamed completion, in ms."""
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data:") and '"text"' in line:
                first = time.perf_counter()
    end = time.perf_counter()
    return 1000 * ((first or end) - t0), 1000 * (end - t0)


def percentiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=100, help="requests through each door")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--out", default="envoy_overhead")
    args = ap.parse_args()
    log_dir = tempfile.mkdtemp(prefix="envoy-overhead-")
    spec = TopologySpec(
        model=ensure_tiny_model("qwen3"),
        prefill=0,
        decode=2,
        kv_events=True,
        gateway="envoy",
        log_dir=log_dir,
        engine_args=["--num-kv-blocks", "512"],
        **SIDE_BY_SIDE,
    )
    topo = Topology(spec)
    topo.start(timeout_s=240)
    gw_port = free_port()
    # our gateway with the picker's routing flags, beside Envoy
    launch = topo.router_launch
    gateway_cmd = gateway_argv(replace(launch, serving=replace(launch.serving, port=gw_port)))
    with open(os.path.join(log_dir, "gateway.log"), "wb") as log:
        gateway = subprocess.Popen(gateway_cmd, stdout=log, stderr=subprocess.STDOUT)
    doors = {
        "pdpool gateway": f"http://127.0.0.1:{gw_port}",
        "Envoy + pdpool epp": topo.gateway.url,
    }
    try:
        deadline = time.monotonic() + 60
        while not healthy(doors["pdpool gateway"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        model = httpx.get(topo.gateway.url + "/v1/models").json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": list(range(3, 99)),
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
        }
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in doors}
        with httpx.Client(timeout=60) as client:
            for url in doors.values():  # warm: the prompt cached, connections open
                for _ in range(5):
                    timed(client, url, body)
            for _ in range(args.requests):
                for name, url in doors.items():
                    results[name].append(timed(client, url, body))
        picker = epp_decision_ms(topo.router.url)
    finally:
        gateway.terminate()
        gateway.wait(10)
        topo.stop()
    rows = []
    for name, samples in results.items():
        ttft = percentiles([s[0] for s in samples])
        total = percentiles([s[1] for s in samples])
        rows.append(
            {
                "front door": name,
                "ttft_p50_ms": ttft[0],
                "ttft_p99_ms": ttft[1],
                "total_p50_ms": total[0],
                "total_p99_ms": total[1],
            }
        )
    base, envoy = rows
    rows.append(
        {
            "front door": "difference",
            **{k: envoy[k] - base[k] for k in base if k != "front door"},
        }
    )
    print_table(rows, f"{args.requests} sequential streamed requests per door, alternating")
    print(
        f"picker's own time per request: p50 {picker.get('epp_ms_p50', float('nan')):.2f} ms, "
        f"p99 {picker.get('epp_ms_p99', float('nan')):.2f} ms"
    )
    write_json(args.out, {"args": vars(args), "rows": rows, "picker": picker})


if __name__ == "__main__":
    main()
