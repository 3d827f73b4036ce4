"""Flow control through `pdpool up`: a quiet tenant at steady load beside noisy ones.

    python benchmarks/flow_control.py [--seconds 8] [--rounds 3] [--noisy-streams 40]
                                      [--weights 1,2,4] [--bound N[,N...]] [--model DIR]

The quiet tenant sends `--quiet-rps` streamed completions a second (Poisson arrivals,
`--max-tokens` each). The noisy tenant keeps `--noisy-streams` long streams open (closed
loop, `--noisy-max-tokens` each; a 429 is retried after its Retry-After, at most 1 s);
`--noisy-streams 0` makes it burst instead (`--noisy-factor` times the quiet rate,
`--burst-s` on, `--pause-s` off). `--weights 1,2,4` replaces the noisy tenant by three
tenants of those weights, each keeping `--noisy-streams` streams open.
Two `pdpool up --prefill 0 --decode N --mode aggregated`, without and with a tenants file,
up at once; --rounds rounds, each running both topologies' two phases of --seconds in turn
(alternating, so the drift of this shared machine's other load reaches all four alike):
  alone-off      the quiet tenant by itself, no tenants file (today's gateway)
  noisy-off      all tenants, no tenants file
  alone-on       the quiet tenant by itself, with the tenants file
  noisy-on       all tenants, with the tenants file: equal weights (or --weights), no
                 limits and no pool section (the engines' learned limit), unless --bound
                 (pool.maxInFlightPerBackend) or the noisy tenant's own limits are given
--warmup-rounds (1) rounds of all of that run first, unmeasured (a fresh topology's first
burst meets cold connection pools and the engine's first big batches, off and on alike).
Reported: the quiet tenant's TTFT p50/p99 (first streamed token) and its p99 against
alone on the same topology, the tokens streamed a second by all tenants (from --settle-s
into each phase to its end; streams still open at the end are cut by the client and
counted as `cut`, not lost) and against the same phase without flow control, each
weighted tenant's share of the weighted tenants' tokens against its weight's, the noisy
429 share, and every request that ended without an answer or a 429 ("lost": must be 0).
The goals: quiet p99 within 1.5x of alone, throughput within 10% of off, shares within
15% of the weights. Writes benchmarks/results/flow_control.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from pdpool.up.topology import SIDE_BY_SIDE, Topology, TopologySpec, ensure_tiny_model

QUIET_KEY = "quiet-tenant-key-000001"
WORDS = "river stone cloud lantern harbor meadow copper violet engine orbit signal garden".split()


@dataclass
class Outcome:
    tenant: str
    status: int  # HTTP status; 0: no answer at all (connection broke, timeout)
    ttft_s: Optional[float] = None
    retry_after: Optional[str] = None
    error: str = ""
    sent_at: float = 0.0  # time.perf_counter() when sent


CUT = -1  # the client ended the stream at the phase's end: neither served nor lost


@dataclass
class Run:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    flow: dict[str, float] = field(default_factory=dict)  # the gateway's pdpool_flow_* sums
    tokens: dict[str, int] = field(default_factory=dict)  # streamed in the measured window
    late_tokens: dict[str, int] = field(default_factory=dict)  # in its second half
    seconds: float = 0.0  # the measured windows' length, all rounds
    quiet_at: list[tuple[float, float]] = field(default_factory=list)  # (s into phase, TTFT ms)


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


def heavy_tenants(args: argparse.Namespace) -> dict[str, float]:
    """The contending tenants: name -> weight."""
    if not args.weights:
        return {"noisy": 1.0}
    return {f"w{w:g}": w for w in (float(x) for x in args.weights.split(","))}


def key_of(tenant: str) -> str:
    return QUIET_KEY if tenant in ("quiet", "warm") else f"{tenant}-tenant-key-{'0' * 12}"


def tenants_yaml(args: argparse.Namespace, bound: int) -> str:
    """Equal or --weights weights and no limits unless asked: nothing tuned by hand."""
    limits = "".join(
        f", {name}: {value}"
        for name, value in (
            ("maxQueued", args.noisy_max_queued),
            ("queueTimeoutSeconds", args.queue_timeout_s),
            ("maxConcurrency", args.noisy_max_concurrency),
        )
        if value
    )
    lines = ["tenants:", f"  - {{name: quiet, keys: ['{QUIET_KEY}'], weight: 1}}"]
    for name, weight in heavy_tenants(args).items():
        lines.append(f"  - {{name: {name}, keys: ['{key_of(name)}'], weight: {weight:g}{limits}}}")
    if bound:
        lines.append(f"pool: {{maxInFlightPerBackend: {bound}}}")
    return "\n".join(lines) + "\n"


def prompt(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Meter:
    """Tokens streamed to each tenant inside the measured window [start, end), and in its
    second half [late, end) (shares once the phase's first requests had time to end)."""

    start: float
    end: float
    tokens: dict[str, int] = field(default_factory=dict)
    late_tokens: dict[str, int] = field(default_factory=dict)

    def token(self, tenant: str) -> None:
        now = time.perf_counter()
        if self.start <= now < self.end:
            self.tokens[tenant] = self.tokens.get(tenant, 0) + 1
            if now >= (self.start + self.end) / 2:
                self.late_tokens[tenant] = self.late_tokens.get(tenant, 0) + 1


async def one(
    client: httpx.AsyncClient, tenant: str, body: dict, meter: Optional[Meter] = None
) -> Outcome:
    start = time.perf_counter()
    headers = {"authorization": f"Bearer {key_of(tenant)}"}
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")[:200]
                return Outcome(
                    tenant, r.status_code, None, r.headers.get("retry-after"), text, start
                )
            ttft = None
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"text"' in line:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    if meter is not None:
                        meter.token(tenant)
                if line.startswith("data: [DONE]"):
                    return Outcome(tenant, 200, ttft, sent_at=start)
            return Outcome(tenant, 0, ttft, error="stream ended without [DONE]", sent_at=start)
    except httpx.HTTPError as exc:
        return Outcome(tenant, 0, None, error=repr(exc), sent_at=start)


def completion(rng: random.Random, args: argparse.Namespace, max_tokens: int) -> dict:
    return {
        "prompt": prompt(rng, args.prompt_words),
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }


async def arrivals(
    client: httpx.AsyncClient, tenant: str, rate_at, args: argparse.Namespace, meter: Meter
) -> list[Outcome]:
    """Open-loop Poisson arrivals at rate_at(t) requests a second for --seconds."""
    rng = random.Random(sum(map(ord, tenant)))  # the same arrivals every run
    tasks = []
    t0 = time.perf_counter()
    while (now := time.perf_counter() - t0) < args.seconds:
        rate = rate_at(now)
        if rate <= 0:
            await asyncio.sleep(0.05)
            continue
        body = completion(rng, args, args.max_tokens)
        tasks.append(asyncio.ensure_future(one(client, tenant, body, meter)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def streams(
    client: httpx.AsyncClient, tenant: str, args: argparse.Namespace, meter: Meter
) -> list[Outcome]:
    """--noisy-streams long streams kept open until the phase ends (then cut)."""

    async def loop(i: int) -> list[Outcome]:
        rng, out = random.Random(i), []
        while (left := meter.end - time.perf_counter()) > 0:
            body = completion(rng, args, args.noisy_max_tokens)
            try:
                o = await asyncio.wait_for(one(client, tenant, body, meter), left)
            except asyncio.TimeoutError:
                out.append(Outcome(tenant, CUT))
                break
            out.append(o)
            if o.status != 200:  # a 429's Retry-After, capped: the flood keeps pressing
                await asyncio.sleep(min(float(o.retry_after or 0.1), 1.0))
        return out

    return [o for part in await asyncio.gather(*map(loop, range(args.noisy_streams))) for o in part]


LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=512)


async def warm(url: str) -> None:
    """The engine's first requests compile and allocate: not part of any run."""
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=LIMITS) as client:
        body = {"prompt": "warm up", "max_tokens": 4, "stream": True}
        await asyncio.gather(*(one(client, "warm", body) for _ in range(4)))


async def heavy_load(
    url: str, args: argparse.Namespace, meter: Meter
) -> tuple[list[Outcome], dict[str, int], dict[str, int]]:
    period = args.burst_s + args.pause_s
    noisy_rate = args.quiet_rps * args.noisy_factor

    def noisy_at(t: float) -> float:
        return noisy_rate if (t % period) < args.burst_s else 0.0

    async with httpx.AsyncClient(base_url=url, timeout=300, limits=LIMITS) as client:
        if args.noisy_streams:
            parts = [streams(client, t, args, meter) for t in heavy_tenants(args)]
        else:
            parts = [arrivals(client, t, noisy_at, args, meter) for t in heavy_tenants(args)]
        outcomes = [o for part in await asyncio.gather(*parts) for o in part]
    return outcomes, meter.tokens, meter.late_tokens


def heavy_process(
    url: str, args: argparse.Namespace, meter: Meter
) -> tuple[list[Outcome], dict[str, int], dict[str, int]]:
    return asyncio.run(heavy_load(url, args, meter))


async def quiet_load(url: str, args: argparse.Namespace, meter: Meter) -> list[Outcome]:
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=LIMITS) as client:
        return await arrivals(client, "quiet", lambda t: args.quiet_rps, args, meter)


def drive(url: str, args: argparse.Namespace, noisy: bool, run: Run) -> None:
    """The quiet tenant from this process; the heavy ones from a process of their own, so
    that parsing their streams never delays the quiet tenant's measured first token."""
    asyncio.run(warm(url))
    first = len(run.outcomes)
    t0 = time.perf_counter()
    meter = Meter(t0 + args.settle_s, t0 + args.seconds)
    run.seconds += args.seconds - args.settle_s
    if not noisy:
        run.outcomes += asyncio.run(quiet_load(url, args, meter))
    else:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
            flood = pool.submit(heavy_process, url, args, meter)
            run.outcomes += asyncio.run(quiet_load(url, args, meter))
            outcomes, tokens, late = flood.result()
        run.outcomes += outcomes
        meter.tokens.update(tokens)
        meter.late_tokens.update(late)
    for tenant, n in meter.tokens.items():
        run.tokens[tenant] = run.tokens.get(tenant, 0) + n
    for tenant, n in meter.late_tokens.items():
        run.late_tokens[tenant] = run.late_tokens.get(tenant, 0) + n
    run.quiet_at += [
        (round(o.sent_at - t0, 3), round(o.ttft_s * 1000, 1))
        for o in run.outcomes[first:]
        if o.tenant == "quiet" and o.ttft_s is not None
    ]


def percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def shares(run: Run, args: argparse.Namespace) -> dict:
    """Each weighted tenant's share of the weighted tenants' tokens / its weight's share,
    over the measured windows and over their second halves (`late`: slots are never taken
    back, so while the phase's first requests run, the order of its first burst decides)."""
    weights = heavy_tenants(args)
    if len(weights) < 2:
        return {}
    out = {}
    for label, tokens in (("", run.tokens), ("late_", run.late_tokens)):
        total = sum(tokens.get(t, 0) for t in weights)
        for t, w in weights.items():
            out[f"{label}share_{t}_vs_weight"] = (
                (tokens.get(t, 0) / total) / (w / sum(weights.values())) if total else None
            )
    return out


def summary(run: Run, args: argparse.Namespace) -> dict:
    quiet = [o for o in run.outcomes if o.tenant == "quiet"]
    noisy = [o for o in run.outcomes if o.tenant != "quiet" and o.status != CUT]
    ttfts = [o.ttft_s * 1000 for o in quiet if o.status == 200 and o.ttft_s is not None]
    lost = [o for o in run.outcomes if o.status not in (200, 429, CUT)]
    no_retry_after = [o for o in run.outcomes if o.status == 429 and not o.retry_after]
    wait_count = run.flow.get("pdpool_flow_queue_wait_seconds_count{quiet}")
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
        "tokens_per_s": sum(run.tokens.values()) / run.seconds if run.seconds else None,
        **shares(run, args),
        "quiet_queue_wait_mean_ms": (
            1000 * run.flow.get("pdpool_flow_queue_wait_seconds_sum{quiet}", 0.0) / wait_count
            if wait_count
            else None
        ),
        "concurrency_limit": run.flow.get("pdpool_flow_concurrency_limit"),
        "cut": sum(o.status == CUT for o in run.outcomes),
        "lost": len(lost),
        "429_without_retry_after": len(no_retry_after),
    }


def run_topologies(
    model: str, args: argparse.Namespace, files: dict[str, Optional[str]]
) -> list[Run]:
    """One `pdpool up` per label (tenants file or None), all up at once; each round runs
    every topology's two phases in turn, the quiet tenant alone then with the noisy ones,
    so this machine's drifting load reaches off and on alike (their ratio is the figure)."""
    runs: dict[str, tuple[Run, Run]] = {
        label: (Run(f"alone-{label}"), Run(f"noisy-{label}")) for label in files
    }
    with contextlib.ExitStack() as stack:
        topos = {
            label: stack.enter_context(
                Topology(
                    TopologySpec(
                        model=model,
                        prefill=0,
                        decode=args.decode,
                        mode="aggregated",
                        tenants_file=file,
                        engine_args=list(args.engine_arg),
                        **SIDE_BY_SIDE,
                    )
                )
            )
            for label, file in files.items()
        }
        for _ in range(args.warmup_rounds):  # not measured: see --warmup-rounds
            for topo in topos.values():
                drive(topo.gateway.url, args, False, Run("warm-up"))
                drive(topo.gateway.url, args, True, Run("warm-up"))
        for _ in range(args.rounds):
            for label, topo in topos.items():
                alone, noisy = runs[label]
                drive(topo.gateway.url, args, False, alone)
                drive(topo.gateway.url, args, True, noisy)
        for label, topo in topos.items():
            runs[label][1].flow = flow_metrics(topo.gateway.url) if files[label] else {}
    out = [run for pair in runs.values() for run in pair]
    for run in out:
        lost = [o for o in run.outcomes if o.status not in (200, 429, CUT)]
        for o in lost[:5]:
            print(f"  lost ({run.name}): {o.tenant} status {o.status} {o.error}", file=sys.stderr)
    return out


def bounds(text: str) -> list[int]:
    try:
        values = [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    if any(v < 0 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"bounds must be distinct and >= 0: {text!r}")
    return values


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="checkpoint (default: the tiny test model)")
    p.add_argument("--seconds", type=float, default=8.0, help="of each phase")
    p.add_argument("--settle-s", type=float, default=1.0, help="tokens counted after this")
    p.add_argument("--quiet-rps", type=float, default=2.0)
    p.add_argument("--noisy-streams", type=int, default=40, help="0: bursts instead")
    p.add_argument("--noisy-max-tokens", type=int, default=256)
    p.add_argument("--weights", help="e.g. 1,2,4: three contending tenants of these weights")
    p.add_argument("--noisy-factor", type=float, default=10.0)
    p.add_argument("--burst-s", type=float, default=3.0)
    p.add_argument("--pause-s", type=float, default=1.0)
    p.add_argument("--prompt-words", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument(
        "--bound",
        type=bounds,
        default=[0],
        help="pool.maxInFlightPerBackend (0: none, the learned limit); a comma list runs a "
        "flow-control topology per bound side by side (labels on, b16, ...)",
    )
    p.add_argument("--noisy-max-queued", type=int, default=0, help="0: the file's default")
    p.add_argument("--noisy-max-concurrency", type=int, default=0, help="0: none")
    p.add_argument("--queue-timeout-s", type=float, default=0, help="0: the file's default")
    p.add_argument("--engine-arg", action="append", default=[])
    p.add_argument("--rounds", type=int, default=3, help="alone / noisy phases, alternating")
    p.add_argument(
        "--warmup-rounds",
        type=int,
        default=1,
        help="rounds run first and not measured: the first burst of a fresh topology meets "
        "cold connection pools and an engine's first big batches (off and on alike)",
    )
    p.add_argument("--only", help="off or on: one topology only")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    model = args.model or ensure_tiny_model("qwen3")
    with tempfile.TemporaryDirectory() as tmp:
        files: dict[str, Optional[str]] = {"off": None}
        for bound in args.bound:
            label = f"b{bound}" if bound else "on"
            files[label] = os.path.join(tmp, f"tenants-{label}.yaml")
            with open(files[label], "w") as f:
                f.write(tenants_yaml(args, bound))
        if args.only:
            files = {k: v for k, v in files.items() if k in args.only.split(",")}
        runs = run_topologies(model, args, files)
    rows = [summary(r, args) for r in runs]
    by_name = {r["run"]: r for r in rows}
    for r in rows:  # against the quiet tenant alone on the same topology, same rounds
        phase, label = r["run"].split("-")
        base = by_name.get("alone-" + label, {}).get("quiet_ttft_p99_ms")
        p99 = r["quiet_ttft_p99_ms"]
        r["p99_vs_alone"] = p99 / base if base and p99 else None
        off = by_name.get(f"{phase}-off", {}).get("tokens_per_s")
        r["tokens_vs_off"] = r["tokens_per_s"] / off if off and r["tokens_per_s"] else None
    print_table(rows, "flow control: the quiet tenant's TTFT (ms), throughput, shares, 429s")
    for run in runs:  # the quiet tenant's slowest first tokens: when in their phase
        slowest = sorted(run.quiet_at, key=lambda p: -p[1])[:4]
        print(
            f"  slowest quiet TTFT ({run.name}): "
            + ", ".join(f"{ms:g} ms at {at:g} s" for at, ms in slowest)
        )
    flows = {r.name: r.flow for r in runs if r.flow}
    write_json(
        "flow_control",
        {
            "args": vars(args),
            "rows": rows,
            "gateway_flow_metrics": flows,
            "quiet_ttft_at": {r.name: r.quiet_at for r in runs},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
