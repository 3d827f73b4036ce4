"""What the fail-closed KV handoff costs, and how fast transfers recover after a restart.

1. Pieces, in process: signing a lease, checking it, the consumer's prefix hash, the
   per-block content check per pulled MB (for a Qwen3-8B-sized block), and one lease `open`
   round trip to a live engine over loopback TCP.
2. End to end, real engines over NIXL: P/D requests (prefill leg, then decode leg) with a
   pool secret and without one; added time per request = the difference of the medians.
3. Recovery: P/D traffic runs continuously while the prefill engine is killed and
   restarted on the same ports; reports requests sent / served / failed / wrong, the time
   from kill to the first successful read, and from the restarted engine's health to it.

    python benchmarks/kv_trust_cost.py [--requests 30] [--prompt 256]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))  # devtools
from common import print_table, write_json

from pdpool.engine.connector import lease_token
from pdpool.engine.connector.handshake import lease_call
from pdpool.engine.connector.load_plan import verified_positions
from pdpool.engine.kv.hashing import BlockHasher, prefix_hash
from devtools.engine_procs import SpawnedEngine, connector_stat
from pdpool.ports import free_port
from pdpool.up.topology import ensure_tiny_model

BLOCK = 16
# One block of Qwen3-8B in bf16: 36 layers x (K, V) x 16 tokens x 8 KV heads x 128 dims x 2 B.
QWEN3_8B_BLOCK_BYTES = 36 * 2 * BLOCK * 8 * 128 * 2


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def pd_request(client: httpx.Client, prefill: str, decode: str, prompt: list[int]) -> tuple:
    """(seconds, decode answer) for one P/D request done as a router does it."""
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    t = time.perf_counter()
    r = client.post(
        f"{prefill}/v1/completions",
        json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    r.raise_for_status()
    kv = r.json()["kv_transfer_params"]
    r = client.post(
        f"{decode}/v1/completions",
        json={**body, "kv_transfer_params": kv, "cache_hit_threshold": 0.0},
    )
    r.raise_for_status()
    return time.perf_counter() - t, r.json()


def time_per_call(fn, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def pieces(prompt_len: int, engine: SpawnedEngine) -> list[dict]:
    secret = b"k" * 32
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_block_ids": list(range(prompt_len // BLOCK)),
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
    }
    prompt = ids(prompt_len, 1)
    hashes = BlockHasher(BLOCK).hash_blocks(prompt, [], prompt_len // BLOCK)
    token = lease_token.LeaseToken(
        "L",
        "E",
        prompt_len,
        prefix_hash(prompt, hashes, prompt_len, BLOCK),
        int(time.time() * 1000) + 60_000,
    )
    signed = lease_token.attach(dict(params), token, secret)
    lease = {"num_tokens": prompt_len, "hashes": [h.hex() for h in hashes], "tail_hash": None}
    n_blocks = len(hashes)
    check_s = time_per_call(
        lambda: verified_positions(0, n_blocks, prompt_len - 1, lease, hashes, None, BLOCK), 200
    )
    pulled_mb = n_blocks * QWEN3_8B_BLOCK_BYTES / 2**20
    open_s = time_per_call(
        lambda: lease_call(
            "127.0.0.1", engine_kv_port(engine), {"op": "renew", "lease_id": "x", "epoch": "y"}
        ),
        50,
    )
    return [
        {
            "piece": "sign params (producer)",
            "us": time_per_call(lambda: lease_token.attach(dict(params), token, secret), 2000)
            * 1e6,
        },
        {
            "piece": "verify params (consumer)",
            "us": time_per_call(lambda: lease_token.read(signed, secret), 2000) * 1e6,
        },
        {
            "piece": f"prefix hash of a {prompt_len}-token prompt",
            "us": time_per_call(lambda: prefix_hash(prompt, hashes, prompt_len - 3, BLOCK), 2000)
            * 1e6,
        },
        {
            "piece": f"content check per pulled MB (Qwen3-8B blocks, {pulled_mb:.0f} MB)",
            "us": check_s / pulled_mb * 1e6,
        },
        {"piece": "lease open/renew round trip (loopback TCP)", "us": open_s * 1e6},
    ]


def engine_kv_port(engine: SpawnedEngine) -> int:
    return int(engine.flags[list(engine.flags).index("--kv-port") + 1])


def end_to_end(model: str, logs: str, n: int, prompt_len: int, secret_file: str) -> list[dict]:
    """Both configurations at once, requests alternating, so drift hits both alike."""
    pairs = {}
    for label, extra in (("no secret", ()), ("pool secret", ("--kv-secret-file", secret_file))):
        common = ("--kv-connector", "nixl", "--num-kv-blocks", "512", *extra)
        pairs[label] = (
            SpawnedEngine(Path(model), Path(logs), *common, "--kv-role", "producer").wait(),
            SpawnedEngine(Path(model), Path(logs), *common, "--kv-role", "consumer").wait(),
        )
    times: dict[str, list[float]] = {label: [] for label in pairs}
    try:
        with httpx.Client(timeout=60) as c:
            for k in range(-3, n):  # three warm-up rounds: handshakes, first allocations
                for label, (P, D) in pairs.items():
                    dt = pd_request(c, P.url, D.url, ids(prompt_len, 1000 + k))[0]
                    if k >= 0:
                        times[label].append(dt)
        return [
            {
                "params": label,
                "requests": n,
                "p50_ms": statistics.median(t) * 1e3,
                "mean_ms": statistics.fmean(t) * 1e3,
                "tokens_pulled": int(connector_stat(pairs[label][1], "tokens_pulled", 0.0)),
            }
            for label, t in times.items()
        ]
    finally:
        for P, D in pairs.values():
            P.stop()
            D.stop()


def recovery(model: str, logs: str, prompt_len: int, secret_file: str) -> dict:
    common = ("--kv-connector", "nixl", "--num-kv-blocks", "512", "--kv-secret-file", secret_file)
    kv_port = free_port()
    P = SpawnedEngine(
        Path(model), Path(logs), *common, "--kv-role", "producer", "--kv-port", str(kv_port)
    ).wait()
    D = SpawnedEngine(Path(model), Path(logs), *common, "--kv-role", "consumer").wait()
    A = SpawnedEngine(Path(model), Path(logs), "--num-kv-blocks", "512").wait()
    counts = {"sent": 0, "served": 0, "failed": 0, "wrong": 0}
    first_read_after: dict = {}
    stop = threading.Event()
    ready_mark: list[float] = []  # when the restarted engine answers /health
    t_kill = t_ready = None

    def traffic():
        k = 0
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                k += 1
                prompt = ids(prompt_len, 50_000 + k)
                counts["sent"] += 1
                pulled0 = connector_stat(D, "tokens_pulled", 0.0)
                started = time.monotonic()
                try:
                    _, out = pd_request(c, P.url, D.url, prompt)
                except httpx.HTTPError:
                    counts["failed"] += 1  # the prefill engine is down (a sidecar falls back)
                    time.sleep(0.05)
                    continue
                ref = c.post(
                    f"{A.url}/v1/completions",
                    json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
                )
                counts["served"] += 1
                if out["choices"][0]["text"] != ref.json()["choices"][0]["text"]:
                    counts["wrong"] += 1
                if (
                    ready_mark
                    and started >= ready_mark[0]
                    and "t" not in first_read_after
                    and connector_stat(D, "tokens_pulled", 0.0) > pulled0
                ):
                    first_read_after["t"] = time.monotonic()

    try:
        worker = threading.Thread(target=traffic)
        worker.start()
        time.sleep(3)
        t_kill = time.monotonic()
        P.kill()
        P.restart()
        t_ready = time.monotonic()
        ready_mark.append(t_ready)
        deadline = time.monotonic() + 60
        while "t" not in first_read_after and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2)
        stop.set()
        worker.join()
        idle_deadline = time.monotonic() + 15
        while time.monotonic() < idle_deadline and (
            connector_stat(P, "leases_active", 0.0) or connector_stat(D, "leases_active", 0.0)
        ):
            time.sleep(0.2)
        t = first_read_after.get("t")
        failed = counts.pop("failed")
        return {
            **counts,
            "failed_while_prefill_down": failed,
            "kill_to_first_read_s": None if t is None else t - t_kill,
            "ready_to_first_read_s": None if t is None else t - t_ready,
            "engine_restart_s": t_ready - t_kill,
            "peers_replaced": connector_stat(D, "peers_replaced", 0.0),
            "leases_held_at_idle": connector_stat(P, "leases_active", 0.0)
            + connector_stat(D, "leases_active", 0.0),
        }
    finally:
        stop.set()
        for e in (P, D, A):
            e.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: tiny Qwen3)")
    args = ap.parse_args()
    model = args.model or ensure_tiny_model("qwen3")
    logs = tempfile.mkdtemp(prefix="kv-trust-")
    secret_file = os.path.join(logs, "secret")
    Path(secret_file).write_text("b" * 64)

    probe = SpawnedEngine(
        Path(model), Path(logs), "--kv-connector", "nixl", "--kv-port", str(free_port())
    ).wait()
    try:
        piece_rows = pieces(args.prompt, probe)
    finally:
        probe.stop()
    print_table(piece_rows, "pieces (microseconds)")
    e2e = end_to_end(model, logs, args.requests, args.prompt, secret_file)
    print_table(e2e, f"P/D request, {args.prompt}-token prompt, 4 output tokens")
    added = e2e[1]["p50_ms"] - e2e[0]["p50_ms"]
    per_request_us = sum(r["us"] for r in piece_rows[:3])
    print(
        f"signing + checking + hashing: {per_request_us:.0f} us of CPU per P/D request "
        f"(pieces); measured p50 difference end to end: {added:+.2f} ms (includes whatever "
        "else the machine is doing)"
    )
    rec = recovery(model, logs, args.prompt, secret_file)
    print_table([rec], "prefill engine killed and restarted under P/D traffic")
    write_json(
        "kv_trust_cost",
        {
            "args": vars(args),
            "pieces": piece_rows,
            "end_to_end": e2e,
            "added_p50_ms": added,
            "added_cpu_us": per_request_us,
            "recovery": rec,
        },
    )


if __name__ == "__main__":
    main()
