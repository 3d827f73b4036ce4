"""pdpool serve vs stock vLLM 0.32 (CPU build) serving the same 8 tiny PEFT adapters, mixed
in one stream of concurrent requests over HTTP; rounds alternate between the two servers
(one at a time, same machine). Goal: ours >= 1.0x vLLM's output throughput.

    python benchmarks/lora_vs_vllm.py [--requests 32] [--prompt-len 128] [--max-tokens 32]
                                      [--rounds 3] [--concurrency 16]

Prints a table and writes benchmarks/results/lora_vs_vllm.json (with the load average).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from common import print_table, write_json
from http_load import run_requests
from lora import NUM_ADAPTERS, make_model_and_adapters


def start_servers(model: Path, adapters: list[Path], logs: Path, rank: int):
    import httpx  # noqa: F401

    from devtools.engine_procs import SpawnedEngine, wait_healthy
    from pdpool.up.topology import VLLM_ARGS, VLLM_ENV, free_port, vllm_command

    modules = [f"a{i}={d}" for i, d in enumerate(adapters)]
    lora = ["--enable-lora", "--max-loras", str(NUM_ADAPTERS), "--max-lora-rank", str(rank)]
    lora += ["--lora-modules", *modules]
    ours = SpawnedEngine(model, logs, "--served-model-name", "base", "--cpu-threads", "1", *lora)
    port = free_port()
    argv = [vllm_command(), "serve", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--served-model-name", "base", *VLLM_ARGS, *lora]
    env = {**os.environ, **VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0"}
    with open(logs / "vllm.log", "wb") as fh:
        proc = subprocess.Popen(
            argv, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    ours.wait(timeout=300)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 900, logs / "vllm.log")
    return ours, proc, url


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, 500) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    rates: dict[str, list[float]] = {"pdpool": [], "vllm": []}
    with tempfile.TemporaryDirectory() as tmp:
        model, adapters = make_model_and_adapters(Path(tmp), args.hidden, args.rank)
        ours, proc, vllm_url = start_servers(model, adapters, Path(tmp), args.rank)
        try:
            for url in (ours.url, vllm_url):  # warm-up: every adapter loaded once
                run_round(url, prompts[:NUM_ADAPTERS], 2, NUM_ADAPTERS)
            for _ in range(args.rounds):
                rates["pdpool"].append(
                    run_round(ours.url, prompts, args.max_tokens, args.concurrency)
                )
                rates["vllm"].append(
                    run_round(vllm_url, prompts, args.max_tokens, args.concurrency)
                )
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            ours.stop()
    load = os.getloadavg()
    ratio = statistics.median(a / b for a, b in zip(rates["pdpool"], rates["vllm"], strict=True))
    rows = [
        {"server": "vLLM 0.32 (CPU)", "out_tok_s": statistics.median(rates["vllm"]), "ratio": 1.0},
        {"server": "pdpool", "out_tok_s": statistics.median(rates["pdpool"]), "ratio": ratio},
    ]
    print_table(
        rows,
        f"{NUM_ADAPTERS} adapters mixed over HTTP: {args.requests} requests x "
        f"{args.prompt_len}+{args.max_tokens} tokens, {args.concurrency} concurrent",
    )
    print(f"goal >= 1.0x vLLM: {'met' if ratio >= 1.0 else 'NOT met'}; load average {load}")
    write_json(
        "lora_vs_vllm",
        {"args": vars(args), "rates": rates, "rows": rows, "ratio": ratio, "loadavg": load},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
