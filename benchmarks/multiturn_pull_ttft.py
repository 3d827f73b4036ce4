"""Multi-turn TTFT: the prefill engine recomputing the history vs pulling it from decode.

Engine level, two real engine processes with NIXL over loopback (the sidecar's flow done
by hand so that only the prefill's source of history differs). Each turn:
  1. the decode engine is asked first with a cache-hit threshold and rejects (the new
     message is long), describing the history it caches;
  2. the prefill leg runs on the prefill engine, pulling that history (`pull`) or
     recomputing it (`recompute`: the description is withheld);
  3. the decode leg pulls the prefill's blocks and streams.
TTFT = from step 1's request to the first streamed token of step 3. The prefill engine
runs with its prefix cache on and off, as in the seed's two figures.

    python benchmarks/multiturn_pull_ttft.py [--conversations 4] [--turns 4]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from common import print_table, write_json
from devtools.engine_procs import SpawnedEngine


def connector_stat(eng, stat: str) -> float:
    for line in httpx.get(f"{eng.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("pdpool_kv_connector{") and f'stat="{stat}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def first_token_time(url: str, body: dict) -> float:
    """perf_counter() when the first streamed token arrives."""
    first = None
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300
    ) as r:
        for line in r.iter_lines():  # read to the end; note the first token's arrival
            if first is None and line.startswith("data:") and "[DONE]" not in line:
                first = time.perf_counter()
    if first is None:
        raise RuntimeError("the decode leg streamed nothing")
    return first


def turn_ttft(P, D, prompt: list[int], max_tokens: int, pull: bool) -> float:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    rejected = httpx.post(
        f"{D.url}/v1/completions", json={**body, "cache_hit_threshold": 0.95}, timeout=300
    ).json()
    assert rejected["choices"][0]["finish_reason"] == "cache_threshold", rejected
    params = {"do_remote_decode": True}
    described = rejected.get("kv_transfer_params") or {}
    if pull and described:
        params.update({k: v for k, v in described.items() if k != "do_remote_prefill"})
    pre = httpx.post(
        f"{P.url}/v1/completions",
        json={**body, "max_tokens": 1, "kv_transfer_params": params},
        timeout=300,
    ).json()
    first = first_token_time(
        D.url, {**body, "cache_hit_threshold": 0.0, "kv_transfer_params": pre["kv_transfer_params"]}
    )
    return first - t0


def run_mode(model: Path, logs: Path, pull: bool, prefix_caching: bool, args) -> dict:
    pflags = [
        "--kv-connector",
        "nixl",
        "--kv-pull-threshold",
        "16",
        "--num-kv-blocks",
        str(args.blocks),
    ]
    if not prefix_caching:
        pflags.append("--no-enable-prefix-caching")
    P = SpawnedEngine(model, logs, *pflags)
    D = SpawnedEngine(model, logs, "--kv-connector", "nixl", "--num-kv-blocks", str(args.blocks))
    try:
        P.wait()
        D.wait()
        rng = random.Random(0)
        convs = [
            [rng.randrange(3, args.vocab) for _ in range(args.first_turn)]
            for _ in range(args.conversations)
        ]
        for c in convs:  # turn 1 runs on the decode engine alone, which caches it
            httpx.post(f"{D.url}/v1/completions", json={"prompt": c, "max_tokens": 1}, timeout=300)
        pulled0 = connector_stat(P, "tokens_pulled")
        computed0 = P.metric("pdpool_computed_tokens_total")
        ttfts = []
        for _ in range(args.turns):
            for c in convs:
                c.extend(rng.randrange(3, args.vocab) for _ in range(args.new_tokens))
                ttfts.append(turn_ttft(P, D, c, args.max_tokens, pull))
                c.extend(rng.randrange(3, args.vocab) for _ in range(args.max_tokens))
        return {
            "prefill_prefix_cache": "on" if prefix_caching else "off",
            "mode": "pull" if pull else "recompute",
            "ttft_p50_ms": statistics.median(ttfts) * 1000,
            "ttft_max_ms": max(ttfts) * 1000,
            "prefill_computed_tokens": int(P.metric("pdpool_computed_tokens_total") - computed0),
            "pulled_tokens": int(connector_stat(P, "tokens_pulled") - pulled0),
        }
    finally:
        P.stop()
        D.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-turn", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help="checkpoint (default: an 8-layer, hidden-512 random Qwen3)",
    )
    args = ap.parse_args()
    model = args.model
    if model is None:
        from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model

        model = write_tiny_model(
            Path(tempfile.mkdtemp()) / "bench",
            TinyModelSpec(
                num_layers=8,
                hidden_size=512,
                intermediate_size=1536,
                num_heads=8,
                num_kv_heads=4,
                head_dim=64,
                vocab_size=2048,
            ),
        )
    args.vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    logs = Path(tempfile.mkdtemp())
    rows = [
        run_mode(model, logs, pull, cache, args)
        for cache in (True, False)
        for pull in (False, True)
    ]
    print_table(
        rows,
        f"{args.conversations} conversations x {args.turns} turns, first turn "
        f"{args.first_turn} tokens, +{args.new_tokens} per turn",
    )
    for cache in ("on", "off"):
        rec, pul = [r for r in rows if r["prefill_prefix_cache"] == cache]
        print(
            f"prefix cache {cache}: pull vs recompute median TTFT "
            f"{1 - pul['ttft_p50_ms'] / rec['ttft_p50_ms']:+.1%} lower "
            f"({rec['ttft_p50_ms'] / pul['ttft_p50_ms']:.2f}x)"
        )
    write_json(
        "multiturn_pull_ttft", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    )


if __name__ == "__main__":
    main()
