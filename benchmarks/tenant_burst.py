"""One tenant's burst, and another tenant's request right behind it, through `pdpool up`.

    python benchmarks/tenant_burst.py [--burst 40] [--reps 30] [--model DIR]

`pdpool up --prefill 0 --decode 1 --mode aggregated` with a tenants file of two tenants
(equal weights, no limits). The client opens `--burst` + 1 keep-alive connections first
(a raw HTTP/1.1 client on asyncio streams: no connection set-up inside the measurement).
Each repetition: the quiet tenant's streamed completion alone (its TTFT alone), then the
noisy tenant's `--burst` completions written at once and the quiet tenant's one right behind
them (its TTFT behind the burst). Reported: the quiet tenant's TTFT p50, mean and max in
both cases, and the noisy tenant's TTFT p50 behind it. What it measures is how long another
tenant's burst holds a request in the front door (the gateway's start gate, flow control)
and in the engine. Results: benchmarks/results/tenant_burst.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import print_table, write_json
from pdpool.up.topology import SIDE_BY_SIDE, Topology, TopologySpec, ensure_tiny_model

KEYS = {"quiet": "quiet-tenant-key-000001", "noisy": "noisy-tenant-key-000001"}
PROMPT = "river stone cloud lantern harbor meadow copper " * 12


def tenants_yaml() -> str:
    lines = ["tenants:"] + [f"  - {{name: {name}, keys: ['{key}']}}" for name, key in KEYS.items()]
    return "\n".join(lines) + "\n"


def request(tenant: str, max_tokens: int) -> bytes:
    body = json.dumps(
        {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    ).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: pdpool\r\n"
        f"Authorization: Bearer {KEYS[tenant]}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def ttft(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], data: bytes) -> float:
    """Sends one streamed request on a keep-alive connection; its time to the first token."""
    reader, writer = conn
    start = time.perf_counter()
    writer.write(data)
    status = await reader.readline()
    while status and not status.startswith(b"HTTP/1.1 "):  # the last answer's chunk framing
        status = await reader.readline()
    if b" 200 " not in status:
        raise SystemExit(f"the gateway answered {status!r}")
    first = None
    while True:
        line = await reader.readline()
        if not line:
            raise SystemExit("the gateway closed a stream before [DONE]")
        if first is None and line.startswith(b"data: {"):
            first = time.perf_counter() - start
        if line.startswith(b"data: [DONE]"):
            break
    if first is None:
        raise SystemExit("a stream ended without a token")
    return first


async def measure(host: str, port: int, burst: int, reps: int) -> dict[str, list[float]]:
    conns = [await asyncio.open_connection(host, port) for _ in range(burst + 1)]
    quiet, noisy = request("quiet", 8), request("noisy", 16)
    out: dict[str, list[float]] = {"alone": [], "behind": [], "noisy": []}
    for rep in range(reps + 2):  # the first two warm the connections and the engine
        alone = await ttft(conns[burst], quiet)
        await asyncio.sleep(0.2)
        flood = [asyncio.create_task(ttft(c, noisy)) for c in conns[:burst]]
        await asyncio.sleep(0)  # the burst's requests are written first
        behind = await ttft(conns[burst], quiet)
        noisy_ttfts = await asyncio.gather(*flood)
        await asyncio.sleep(0.3)
        if rep >= 2:
            out["alone"].append(alone * 1000)
            out["behind"].append(behind * 1000)
            out["noisy"].append(statistics.median(noisy_ttfts) * 1000)
    for _, writer in conns:
        writer.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint (default: the tiny test model)")
    p.add_argument("--burst", type=int, default=40)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    model = args.model or ensure_tiny_model("qwen3")
    with tempfile.TemporaryDirectory() as tmp:
        tenants = os.path.join(tmp, "tenants.yaml")
        with open(tenants, "w") as f:
            f.write(tenants_yaml())
        spec = TopologySpec(
            model=model,
            prefill=0,
            decode=1,
            mode="aggregated",
            tenants_file=tenants,
            **SIDE_BY_SIDE,
        )
        with Topology(spec) as topo:
            host, port = topo.gateway.url.split("//", 1)[1].rsplit(":", 1)
            ttfts = asyncio.run(measure(host, int(port), args.burst, args.reps))
    rows = [
        {
            "case": case,
            "ttft_p50_ms": statistics.median(values),
            "ttft_mean_ms": statistics.mean(values),
            "ttft_max_ms": max(values),
        }
        for case, values in (
            ("quiet alone", ttfts["alone"]),
            (f"quiet behind {args.burst} of noisy", ttfts["behind"]),
            (f"noisy, median of its {args.burst}", ttfts["noisy"]),
        )
    ]
    print_table(
        rows, f"tenant burst: TTFT (ms), {args.reps} repetitions, load {os.getloadavg()[0]:.2f}"
    )
    write_json("tenant_burst", {"args": vars(args), "rows": rows, "ttfts_ms": ttfts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
