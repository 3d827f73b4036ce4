"""Multi-turn chat through `pdpool up` in four P/D modes.

    python benchmarks/multiturn_modes.py [--conversations 4] [--turns 6] [--model DIR]

Several concurrent conversations with growing histories, alternating long turns (a long
new user message) and short ones, streamed through the gateway. Modes:
  aggregated               the decode engine does everything (sidecar passes through)
  prefill-first            every turn is prefilled on a prefill engine first
  decode-first             decode serves turns whose prompt is mostly cached; others are
                           rejected and prefilled remotely (prefill recomputes the history)
  decode-first+pull        as above, and prefill pulls the history from decode's cache
Reported per mode: TTFT p50/p99, output tokens/s, prompt tokens computed on prefill and
decode engines, prefill legs, and KV bytes moved (when the engines export it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pdpool.up.topology import SIDE_BY_SIDE, Topology, TopologySpec, ensure_tiny_model

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODES = {
    "aggregated": dict(mode="aggregated"),
    "prefill-first": dict(mode="prefill-first"),
    "decode-first": dict(mode="decode-first", pull_from_decode=False),
    "decode-first+pull": dict(mode="decode-first", pull_from_decode=True),
}


def scrape(url: str) -> dict[str, float]:
    """name{labels} -> value, and bare name -> sum over labels."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            value = float(m.group(3))
            out[m.group(1)] = out.get(m.group(1), 0.0) + value
            if m.group(2):
                out[m.group(1) + m.group(2)] = value
    return out


def kv_stat(metrics: dict[str, float], stat: str) -> float:
    """A KV connector counter of one engine (bytes_read, tokens_pulled, ...)."""
    return sum(
        v
        for k, v in metrics.items()
        if k.startswith("pdpool_kv_connector{") and f'stat="{stat}"' in k
    )


def words(rng: random.Random, n: int, tag: str) -> str:
    vocab = [
        "river",
        "stone",
        "cloud",
        "lantern",
        "harbor",
        "meadow",
        "copper",
        "violet",
        "engine",
        "orbit",
        "signal",
        "garden",
        "winter",
        "market",
        "candle",
        "forest",
    ]
    return f"[{tag}] " + " ".join(rng.choice(vocab) for _ in range(n))


async def conversation(
    client: httpx.AsyncClient,
    model: str,
    idx: int,
    turns: int,
    long_words: int,
    short_words: int,
    max_tokens: int,
    ttfts: list,
    counts: dict,
) -> None:
    rng = random.Random(idx)
    messages = [{"role": "system", "content": words(rng, 40, f"conv {idx} system")}]
    for t in range(turns):
        long_turn = t % 3 == 0
        messages.append(
            {
                "role": "user",
                "content": words(
                    rng, long_words if long_turn else short_words, f"conv {idx} turn {t}"
                ),
            }
        )
        started = time.perf_counter()
        first, text, completion = None, [], 0
        async with client.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "model": model,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as r:
            if r.status_code != 200:
                raise RuntimeError(f"turn failed: {r.status_code} {await r.aread()!r}")
            counts[r.headers.get("x-pdpool-path", "?")] = (
                counts.get(r.headers.get("x-pdpool-path", "?"), 0) + 1
            )
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece and first is None:
                        first = time.perf_counter() - started
                    text.append(piece)
                if chunk.get("usage"):
                    completion = chunk["usage"]["completion_tokens"]
                    counts["prompt_tokens"] = (
                        counts.get("prompt_tokens", 0) + chunk["usage"]["prompt_tokens"]
                    )
        ttfts.append(first if first is not None else time.perf_counter() - started)
        counts["output_tokens"] = counts.get("output_tokens", 0) + completion
        messages.append({"role": "assistant", "content": "".join(text)})


def pct(values, q):
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)] if values else float("nan")


def run_mode(name: str, args, model_dir: str) -> dict:
    spec = TopologySpec(
        model=model_dir,
        prefill=args.prefill,
        decode=args.decode,
        cache_hit_threshold=args.threshold,
        device=args.device,
        engine_args=["--max-model-len", "4096", "--num-kv-blocks", str(args.kv_blocks)],
        **MODES[name],
        **SIDE_BY_SIDE,
    )
    with Topology(spec) as topo:
        engines = {role: [c.url for c in topo.by_role(role)] for role in ("prefill", "decode")}
        before = {u: scrape(u) for urls in engines.values() for u in urls}
        side_before = [scrape(c.url) for c in topo.by_role("sidecar")]
        model = httpx.get(topo.gateway.url + "/v1/models").json()["data"][0]["id"]
        ttfts, counts = [], {}

        async def workload():
            async with httpx.AsyncClient(base_url=topo.gateway.url, timeout=600) as client:
                await asyncio.gather(
                    *(
                        conversation(
                            client,
                            model,
                            i,
                            args.turns,
                            args.long_words,
                            args.short_words,
                            args.max_tokens,
                            ttfts,
                            counts,
                        )
                        for i in range(args.conversations)
                    )
                )

        started = time.perf_counter()
        asyncio.run(workload())
        wall = time.perf_counter() - started
        after = {u: scrape(u) for urls in engines.values() for u in urls}
        side_after = [scrape(c.url) for c in topo.by_role("sidecar")]

    def delta(url, key):
        return after[url].get(key, 0.0) - before[url].get(key, 0.0)

    def prompt_computed(role):
        # tokens run through the model minus one per generated token
        return sum(
            delta(u, "pdpool_computed_tokens_total") - delta(u, "pdpool_generation_tokens_total")
            for u in engines[role]
        )

    prefill_legs = sum(
        a.get('pdpool_sidecar_legs_total{leg="prefill"}', 0)
        - b.get('pdpool_sidecar_legs_total{leg="prefill"}', 0)
        for a, b in zip(side_after, side_before, strict=True)
    )

    def kv_delta(role, stat):
        return sum(kv_stat(after[u], stat) - kv_stat(before[u], stat) for u in engines[role])

    has_kv_metric = any(
        k.startswith("pdpool_kv_connector{")
        for urls in engines.values()
        for u in urls
        for k in after[u]
    )
    return {
        "mode": name,
        "turns": len(ttfts),
        "wall_s": wall,
        "ttft_p50_ms": pct(ttfts, 0.5) * 1e3,
        "ttft_p99_ms": pct(ttfts, 0.99) * 1e3,
        "output_tok_s": counts.get("output_tokens", 0) / wall,
        "prefill_engine_prompt_tokens": prompt_computed("prefill"),
        "decode_engine_prompt_tokens": prompt_computed("decode"),
        "prefill_legs": prefill_legs,
        "kv_bytes_moved": (kv_delta("prefill", "bytes_read") + kv_delta("decode", "bytes_read"))
        if has_kv_metric
        else None,
        "tokens_pulled_by_decode": kv_delta("decode", "tokens_pulled"),
        "tokens_pulled_by_prefill": kv_delta("prefill", "tokens_pulled"),
        "prompt_tokens": counts.get("prompt_tokens", 0),
        "paths": {k: v for k, v in counts.items() if k not in ("output_tokens", "prompt_tokens")},
        "kv_connector": topo.kv_connector,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint (default: the tiny model)")
    ap.add_argument("--arch", default="qwen3")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--long-words", type=int, default=300)
    ap.add_argument("--short-words", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threshold", type=float, default=0.8)
    ap.add_argument("--kv-blocks", type=int, default=1024)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    model_dir = args.model or ensure_tiny_model(args.arch)
    rows = []
    for name in args.modes.split(","):
        print(f"running {name} ...", flush=True)
        rows.append(run_mode(name, args, model_dir))
    print(
        f"\nmulti-turn chat: {args.conversations} conversations x {args.turns} turns "
        f"(long turn = {args.long_words} words every 3rd turn), {args.max_tokens} output "
        f"tokens, device {args.device}, KV connector {rows[0]['kv_connector']}; "
        f"{rows[0]['prompt_tokens']} prompt tokens sent in all"
    )
    head = (
        f"{'mode':<19}{'TTFT p50':>10}{'TTFT p99':>10}{'out tok/s':>10}"
        f"{'P prompt tok':>13}{'D prompt tok':>13}{'P legs':>7}{'KV MB':>8}"
        f"{'D<-P tok':>9}{'P<-D tok':>9}  paths"
    )
    print(head)
    for r in rows:
        kv = "n/a" if r["kv_bytes_moved"] is None else f"{r['kv_bytes_moved'] / 1e6:.1f}"
        print(
            f"{r['mode']:<19}{r['ttft_p50_ms']:>8.0f}ms{r['ttft_p99_ms']:>8.0f}ms"
            f"{r['output_tok_s']:>10.1f}{r['prefill_engine_prompt_tokens']:>13.0f}"
            f"{r['decode_engine_prompt_tokens']:>13.0f}{r['prefill_legs']:>7.0f}{kv:>8}"
            f"{r['tokens_pulled_by_decode']:>9.0f}{r['tokens_pulled_by_prefill']:>9.0f}  "
            f"{r['paths']}"
        )
    os.makedirs(RESULTS, exist_ok=True)
    out = os.path.join(RESULTS, "multiturn_modes.json")
    with open(out, "w") as fh:
        json.dump({"args": vars(args), "rows": rows}, fh, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
