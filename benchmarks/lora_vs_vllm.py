"""pdpool serve vs stock vLLM 0.32 (CPU build) serving the same 8 tiny PEFT adapters, mixed
in one stream of concurrent requests over HTTP. Goal: ours >= 1.0x vLLM's output throughput
at equal cores.

    python benchmarks/lora_vs_vllm.py [--requests 32] [--prompt-len 128] [--max-tokens 32]
                                      [--rounds 3] [--concurrency 16] [--no-defaults-column]

Equal cores, as benchmarks/engine_vs_vllm.py: vLLM gets every core this process may use
(`VLLM_CPU_OMP_THREADS_BIND` set to all of them), pdpool serve its own default (torch gets
every usable core but one for decode steps, every core for long prompt chunks:
engine/cpu_threads.py). A third server, vLLM on its own default bind (one OpenMP core, the
other kept for its frontend), gives the defaults-vs-defaults column. Each server runs its
round alone (the others SIGSTOPped); rounds cycle through the servers, and the ratio that
counts is the median over rounds of ours / equal-cores vLLM in the same round.

Prints a table and writes benchmarks/results/lora_vs_vllm.json (with the load average).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from common import print_table, write_json
from engine_vs_vllm import Server, all_cores_bind
from http_load import run_requests
from lora import NUM_ADAPTERS, make_model_and_adapters


def lora_args(adapters: list[Path], rank: int) -> list[str]:
    modules = [f"a{i}={d}" for i, d in enumerate(adapters)]
    return [
        "--enable-lora",
        "--max-loras",
        str(NUM_ADAPTERS),
        "--max-lora-rank",
        str(rank),
        "--lora-modules",
        *modules,
    ]


def start_servers(model: Path, adapters: list[Path], logs: Path, rank: int, defaults: bool):
    from pdpool.up.topology import VLLM_ARGS, VLLM_ENV, free_port, pdpool_command, vllm_command

    lora = lora_args(adapters, rank)
    port = free_port()
    ours = ["serve", str(model), "--port", str(port), "--device", "cpu", "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # its own default
    os.environ.pop("OMP_NUM_THREADS", None)
    servers = [
        Server(
            "pdpool",
            pdpool_command(*ours, "--served-model-name", "base", *lora),
            port,
            str(logs / "pdpool.log"),
            env,
        )
    ]
    binds = {"vllm": all_cores_bind()}
    if defaults:
        binds["vllm_default"] = None
    for name, bind in binds.items():
        port = free_port()
        argv = [vllm_command(), "serve", str(model), "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--served-model-name", "base", *VLLM_ARGS, *lora]
        venv = dict(VLLM_ENV)
        if bind:
            venv["VLLM_CPU_OMP_THREADS_BIND"] = bind
        servers.append(Server(name, argv, port, str(logs / f"{name}.log"), venv))
    return servers


def run_round(url: str, prompts, max_tokens: int, concurrency: int) -> float:
    bodies = [
        {
            "model": f"a{i % NUM_ADAPTERS}",
            "prompt": p,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i, p in enumerate(prompts)
    ]
    results, wall = run_requests(url, bodies, concurrency)
    return sum(r.completion_tokens for r in results) / wall


def alone(servers: list, s, fn):
    """fn() while every other server is SIGSTOPped."""
    others = [o for o in servers if o is not s]
    for o in others:
        o.signal(signal.SIGSTOP)
    try:
        return fn()
    finally:
        for o in others:
            o.signal(signal.SIGCONT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument(
        "--no-defaults-column",
        dest="defaults_column",
        action="store_false",
        help="skip the third server (vLLM on its own default bind)",
    )
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, 500) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model, adapters = make_model_and_adapters(Path(tmp), args.hidden, args.rank)
        servers = start_servers(model, adapters, Path(tmp), args.rank, args.defaults_column)
        rates: dict[str, list[float]] = {s.name: [] for s in servers}
        try:
            for s in servers:
                s.wait()
            for s in servers:  # warm-up: every adapter loaded once
                alone(servers, s, lambda s=s: run_round(s.url, prompts[:NUM_ADAPTERS], 2, 8))
            for r in range(args.rounds):
                for s in servers:
                    rate = alone(
                        servers,
                        s,
                        lambda s=s: run_round(s.url, prompts, args.max_tokens, args.concurrency),
                    )
                    rates[s.name].append(rate)
                    print(f"  round {r + 1} {s.name}: {rate:.0f} tok/s", flush=True)
        finally:
            for s in servers:
                s.stop()
    load = os.getloadavg()

    def ratio_to(name: str) -> float:
        return statistics.median(a / b for a, b in zip(rates["pdpool"], rates[name], strict=True))

    ratio = ratio_to("vllm")
    labels = {"vllm": "vLLM 0.32 (CPU), every core", "vllm_default": "vLLM 0.32, its default"}
    rows = [
        {"server": labels[n], "out_tok_s": statistics.median(rates[n]), "ours_over_it": ratio_to(n)}
        for n in rates
        if n != "pdpool"
    ]
    ours = {"server": "pdpool (its default)", "out_tok_s": statistics.median(rates["pdpool"])}
    rows.insert(0, {**ours, "ours_over_it": 1.0})
    print_table(
        rows,
        f"{NUM_ADAPTERS} adapters mixed over HTTP: {args.requests} requests x "
        f"{args.prompt_len}+{args.max_tokens} tokens, {args.concurrency} concurrent, "
        f"median of {args.rounds} rounds",
    )
    print(
        f"goal >= 1.0x vLLM at equal cores: {'met' if ratio >= 1.0 else 'NOT met'} "
        f"({ratio:.2f}x); load average before {load_before}, after {load}"
    )
    payload = {
        "args": vars(args),
        "vllm_bind": all_cores_bind(),
        "rates": rates,
        "rows": rows,
        "ratio": ratio,
        "goal_met": ratio >= 1.0,
        "loadavg_before": load_before,
        "loadavg": load,
    }
    if "vllm_default" in rates:
        payload["ratio_defaults"] = ratio_to("vllm_default")
    write_json("lora_vs_vllm", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
