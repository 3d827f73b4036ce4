"""Flow control through `pdpool up`: a quiet tenant at steady load, a noisy one bursting.

    python benchmarks/flow_control.py [--seconds 8] [--rounds 3] [--quiet-rps 2] [--noisy-factor 10]
                                      [--bound 2] [--max-tokens 32] [--model DIR]

The quiet tenant sends `--quiet-rps` streamed completions a second (Poisson arrivals); the
noisy tenant bursts to `--noisy-factor` times that rate (`--burst-s` on, `--pause-s` off).
Two `pdpool up --prefill 0 --decode N --mode aggregated`, without and with the tenants
file; on each, --rounds rounds of two phases of --seconds (alternating, so the drift of
this shared machine's other load reaches both alike):
  alone-off      the quiet tenant by itself, no tenants file (today's gateway)
  noisy-off      both tenants, no tenants file
  alone-on       the quiet tenant by itself, with the tenants file
  noisy-on       both tenants, with the tenants file (maxInFlightPerBackend = --bound;
                 the noisy tenant may queue --noisy-max-queued for --queue-timeout-s,
                 and hold --noisy-max-concurrency at once when given)
Reported: the quiet tenant's TTFT p50/p99 (first streamed token), the noisy tenant's 429
share, and every request that ended without an answer or a 429 ("lost": must be 0).
The goal: with flow control on, the quiet tenant's p99 within 1.5x of its p99 alone.
Writes benchmarks/results/flow_control.json.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import print_table, write_json
from pdpool.up.topology import Topology, TopologySpec, ensure_tiny_model

QUIET_KEY, NOISY_KEY = "quiet-tenant-key-000001", "noisy-tenant-key-000002"
WORDS = "river stone cloud lantern harbor meadow copper violet engine orbit signal garden".split()


@dataclass
class Outcome:
    tenant: str
    status: int  # HTTP status; 0: no answer at all (connection broke, timeout)
    ttft_s: Optional[float] = None
    retry_after: Optional[str] = None
    error: str = ""


@dataclass
class Run:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    flow: dict[str, float] = field(default_factory=dict)  # the gateway's pdpool_flow_* sums


def flow_metrics(url: str) -> dict[str, float]:
    """pdpool_flow_* samples of the gateway, summed over bands: name{tenant} -> value."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if not line.startswith("pdpool_flow_") or "_created" in line:
            continue
        if "{" not in line:
            name, _, value = line.partition(" ")
            out[name] = float(value)
            continue
        name, _, rest = line.partition("{")
        labels, _, value = rest.rpartition("} ")
        tenant = next((p[8:-1] for p in labels.split(",") if p.startswith("tenant=")), "")
        reason = next((p[8:-1] for p in labels.split(",") if p.startswith("reason=")), "")
        key = f"{name}{{{tenant}{',' + reason if reason else ''}}}"
        out[key] = out.get(key, 0.0) + float(value)
    return out


def tenants_yaml(args: argparse.Namespace) -> str:
    return (
        "tenants:\n"
        f"  - {{name: quiet, keys: ['{QUIET_KEY}'], weight: 1}}\n"
        f"  - {{name: noisy, keys: ['{NOISY_KEY}'], weight: 1, "
        f"maxQueued: {args.noisy_max_queued}, queueTimeoutSeconds: {args.queue_timeout_s}, "
        f"maxConcurrency: {args.noisy_max_concurrency}}}\n"
        f"pool: {{maxInFlightPerBackend: {args.bound}, "
        f"queueDepthThreshold: {args.queue_depth}}}\n"
    )


def prompt(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def one(client: httpx.AsyncClient, tenant: str, key: str, body: dict) -> Outcome:
    start = time.perf_counter()
    try:
        async with client.stream(
            "POST", "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}
        ) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")[:200]
                return Outcome(tenant, r.status_code, None, r.headers.get("retry-after"), text)
            ttft = None
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: {") and '"text"' in line:
                    ttft = time.perf_counter() - start
                if line.startswith("data: [DONE]"):
                    return Outcome(tenant, 200, ttft)
            return Outcome(tenant, 0, ttft, error="stream ended without [DONE]")
    except httpx.HTTPError as exc:
        return Outcome(tenant, 0, None, error=repr(exc))


async def arrivals(
    client: httpx.AsyncClient,
    tenant: str,
    key: str,
    rate_at,
    seconds: float,
    args: argparse.Namespace,
    seed: int,
) -> list[Outcome]:
    """Open-loop Poisson arrivals at rate_at(t) requests a second for `seconds`."""
    rng = random.Random(seed)
    tasks = []
    t0 = time.perf_counter()
    while (now := time.perf_counter() - t0) < seconds:
        rate = rate_at(now)
        if rate <= 0:
            await asyncio.sleep(0.05)
            continue
        body = {
            "prompt": prompt(rng, args.prompt_words),
            "max_tokens": args.max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        tasks.append(asyncio.ensure_future(one(client, tenant, key, body)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=512)


async def warm(url: str) -> None:
    """The engine's first requests compile and allocate: not part of any run."""
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=LIMITS) as client:
        body = {"prompt": "warm up", "max_tokens": 4, "stream": True}
        await asyncio.gather(*(one(client, "warm", QUIET_KEY, body) for _ in range(4)))


async def tenant_load(url: str, tenant: str, args: argparse.Namespace) -> list[Outcome]:
    period = args.burst_s + args.pause_s
    noisy_rate = args.quiet_rps * args.noisy_factor

    def noisy_at(t: float) -> float:
        return noisy_rate if (t % period) < args.burst_s else 0.0

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=LIMITS) as client:
        if tenant == "quiet":
            return await arrivals(
                client, "quiet", QUIET_KEY, lambda t: args.quiet_rps, args.seconds, args, 1
            )
        return await arrivals(client, "noisy", NOISY_KEY, noisy_at, args.seconds, args, 2)


def noisy_process(url: str, args: argparse.Namespace) -> list[Outcome]:
    return asyncio.run(tenant_load(url, "noisy", args))


def drive(url: str, args: argparse.Namespace, noisy: bool) -> list[Outcome]:
    """The quiet tenant from this process; the noisy one from a process of its own, so
    that parsing its streams never delays the quiet tenant's measured first token."""
    asyncio.run(warm(url))
    if not noisy:
        return asyncio.run(tenant_load(url, "quiet", args))
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        flood = pool.submit(noisy_process, url, args)
        quiet = asyncio.run(tenant_load(url, "quiet", args))
        return quiet + flood.result()


def percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(run: Run) -> dict:
    quiet = [o for o in run.outcomes if o.tenant == "quiet"]
    noisy = [o for o in run.outcomes if o.tenant == "noisy"]
    ttfts = [o.ttft_s * 1000 for o in quiet if o.status == 200 and o.ttft_s is not None]
    lost = [o for o in run.outcomes if o.status not in (200, 429)]
    no_retry_after = [o for o in run.outcomes if o.status == 429 and not o.retry_after]
    return {
        "run": run.name,
        "quiet_sent": len(quiet),
        "quiet_ok": sum(o.status == 200 for o in quiet),
        "quiet_429": sum(o.status == 429 for o in quiet),
        "quiet_ttft_p50_ms": percentile(ttfts, 0.5),
        "quiet_ttft_p99_ms": percentile(ttfts, 0.99),
        "quiet_ttft_mean_ms": statistics.fmean(ttfts) if ttfts else None,
        "noisy_sent": len(noisy),
        "noisy_ok": sum(o.status == 200 for o in noisy),
        "noisy_429_share": (sum(o.status == 429 for o in noisy) / len(noisy)) if noisy else None,
        "quiet_queue_wait_mean_ms": (
            1000
            * run.flow.get("pdpool_flow_queue_wait_seconds_sum{quiet}", 0.0)
            / run.flow["pdpool_flow_queue_wait_seconds_count{quiet}"]
            if run.flow.get("pdpool_flow_queue_wait_seconds_count{quiet}")
            else None
        ),
        "lost": len(lost),
        "429_without_retry_after": len(no_retry_after),
    }


def run_topology(
    label: str, model: str, args: argparse.Namespace, tenants: Optional[str]
) -> list[Run]:
    """One `pdpool up`; the quiet tenant alone and with the noisy one, alternating for
    --rounds rounds (this machine's other load drifts: both see the same drift)."""
    spec = TopologySpec(
        model=model,
        prefill=0,
        decode=args.decode,
        mode="aggregated",
        tenants_file=tenants,
        engine_args=list(args.engine_arg),
    )
    alone, noisy = Run(f"alone-{label}"), Run(f"noisy-{label}")
    with Topology(spec) as topo:
        for _ in range(args.rounds):
            alone.outcomes += drive(topo.gateway.url, args, noisy=False)
            noisy.outcomes += drive(topo.gateway.url, args, noisy=True)
        noisy.flow = flow_metrics(topo.gateway.url) if tenants else {}
    for run in (alone, noisy):
        lost = [o for o in run.outcomes if o.status not in (200, 429)]
        for o in lost[:5]:
            print(f"  lost ({run.name}): {o.tenant} status {o.status} {o.error}", file=sys.stderr)
    return [alone, noisy]


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="checkpoint (default: the tiny test model)")
    p.add_argument("--seconds", type=float, default=8.0, help="of each phase")
    p.add_argument("--quiet-rps", type=float, default=2.0)
    p.add_argument("--noisy-factor", type=float, default=10.0)
    p.add_argument("--burst-s", type=float, default=3.0)
    p.add_argument("--pause-s", type=float, default=1.0)
    p.add_argument("--prompt-words", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--bound", type=int, default=2, help="maxInFlightPerBackend")
    p.add_argument(
        "--queue-depth", type=int, default=4, help="queueDepthThreshold (engine waiting)"
    )
    p.add_argument("--noisy-max-queued", type=int, default=8)
    p.add_argument(
        "--noisy-max-concurrency",
        type=int,
        default=0,
        help="the noisy tenant's maxConcurrency (0: none, the pool's bound and shares only)",
    )
    p.add_argument("--queue-timeout-s", type=float, default=2.0)
    p.add_argument("--engine-arg", action="append", default=[])
    p.add_argument("--rounds", type=int, default=3, help="alone / noisy phases, alternating")
    p.add_argument("--only", help="off or on: one topology only")
    args = p.parse_args()
    model = args.model or ensure_tiny_model("qwen3")
    with tempfile.TemporaryDirectory() as tmp:
        tenants = os.path.join(tmp, "tenants.yaml")
        with open(tenants, "w") as f:
            f.write(tenants_yaml(args))
        runs = [
            run
            for label, file in (("off", None), ("on", tenants))
            if not args.only or label in args.only.split(",")
            for run in run_topology(label, model, args, file)
        ]
    rows = [summary(r) for r in runs]
    by_name = {r["run"]: r for r in rows}
    for r in rows:  # against the quiet tenant alone on the same topology, same rounds
        base = by_name.get("alone-" + r["run"].split("-")[1], {}).get("quiet_ttft_p99_ms")
        off = by_name.get("alone-off", {}).get("quiet_ttft_p99_ms")
        p99 = r["quiet_ttft_p99_ms"]
        r["p99_vs_alone"] = p99 / base if base and p99 else None
        r["p99_vs_alone_off"] = p99 / off if off and p99 else None
    print_table(rows, "flow control: the quiet tenant's TTFT (ms) and the noisy tenant's 429s")
    flows = {r.name: r.flow for r in runs if r.flow}
    write_json("flow_control", {"args": vars(args), "rows": rows, "gateway_flow_metrics": flows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
