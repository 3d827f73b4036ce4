"""KV transfer throughput: NIXL READ between two processes vs memcpy in one process.

    python benchmarks/kv_transfer_bandwidth.py [--runs 7] [--ucx-tls tcp]

A producer process registers two regions with a real `NixlTransport` and serves its
handshake; this process (the consumer) connects through `connect_peer` and READs
1, 4, 16, 64, 256 MB of them over UCX on loopback:
  contiguous  region of 1 MiB units, ids 0..n-1 -> 0..n-1 (NIXL can merge descriptors)
  scattered   region of 64 KiB units, every other remote unit into reversed local ids
              (no merging: one descriptor per unit, like per-layer KV blocks)
and compares with `dst.copy_(src)` of the same bytes in one process (torch with ONE thread:
one memcpy stream, what a single UCX stream can at best approach; torch's thread pool only
adds wake-up noise on a busy 2-core machine). 1 MB fits in cache, so its memcpy figure is a
cache, not a memory-bus, speed.
Each figure is the median of --runs timed runs after one warm-up. Prints a table and
writes benchmarks/results/kv_transfer_bandwidth.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MiB = 1 << 20
SIZES_MB = (1, 4, 16, 64, 256)
BIG_UNIT, SMALL_UNIT = MiB, 64 << 10
LAYOUT = {"model": "bandwidth-benchmark", "dtype": "uint8", "block_size": 1}


def region_shapes(max_mb: int) -> dict[str, tuple[int, int]]:
    return {
        "big": (max_mb * MiB // BIG_UNIT, BIG_UNIT),
        "small": (2 * max_mb * MiB // SMALL_UNIT, SMALL_UNIT),
    }


def region_content(name: str, shape: tuple[int, int]):
    """The producer's bytes, reproducible so the consumer can check what it read."""
    import torch

    gen = torch.Generator().manual_seed(sorted(region_shapes(1)).index(name))
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


def producer(conn, max_mb: int) -> None:
    from pdpool.engine.connector.handshake import HandshakeServer, document_for
    from pdpool.engine.connector.nixl_transport import NixlTransport

    transport = NixlTransport("bench-producer")
    keep = []
    for name, shape in region_shapes(max_mb).items():
        t = region_content(name, shape)
        keep.append(t)
        transport.register_region(name, t)
    server = HandshakeServer(document_for(transport, LAYOUT), host="127.0.0.1", port=0)
    conn.send(server.port)
    conn.recv()  # "stop"
    server.close()
    transport.close()


def timed_read(transport, peer, units) -> float:
    from pdpool.engine.connector.nixl_transport import TransferState

    start = time.perf_counter()
    tid = transport.start_read(peer, units)
    while (state := transport.poll(tid)) is TransferState.IN_PROGRESS:
        pass
    elapsed = time.perf_counter() - start
    transport.release(tid)
    if state is not TransferState.DONE:
        raise RuntimeError(f"transfer failed: {transport.transfer(tid).error}")
    return elapsed


def timed_copy(dst, src) -> float:
    start = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - start


def median_time(fn, runs: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(runs))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument(
        "--ucx-tls",
        default=None,
        help="set UCX_TLS for both processes (e.g. tcp; default: UCX picks)",
    )
    parser.add_argument("--sizes", default=",".join(map(str, SIZES_MB)))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

    import torch

    torch.set_num_threads(1)
    from pdpool.engine.connector.allowlist import parse_allowlist
    from pdpool.engine.connector.nixl_transport import NixlTransport
    from pdpool.engine.connector.peering import connect_peer

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=producer, args=(child, max(sizes)), daemon=True)
    proc.start()
    rows = []
    try:
        port = conn.recv()
        transport = NixlTransport("bench-consumer")
        local = {}
        for name, shape in region_shapes(max(sizes)).items():
            local[name] = torch.zeros(shape, dtype=torch.uint8)
            transport.register_region(name, local[name])
        t0 = time.perf_counter()
        peer = connect_peer(
            transport, "127.0.0.1", port, allowlist=parse_allowlist(""), local_layout=LAYOUT
        ).agent_name
        handshake_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        timed_read(transport, peer, {"big": ([0], [0])})
        first_read_ms = (time.perf_counter() - t0) * 1e3

        for mb in sizes:
            nbytes = mb * MiB
            n_big, n_small = nbytes // BIG_UNIT, nbytes // SMALL_UNIT
            contiguous = {"big": (list(range(n_big)), list(range(n_big)))}
            scattered = {"small": (list(range(n_small))[::-1], list(range(0, 2 * n_small, 2)))}
            t_contig = median_time(partial(timed_read, transport, peer, contiguous), args.runs)
            t_scatter = median_time(partial(timed_read, transport, peer, scattered), args.runs)
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
            dst = torch.empty_like(src)
            t_copy = median_time(partial(timed_copy, dst, src), args.runs)
            rows.append(
                {
                    "size_mb": mb,
                    "nixl_contiguous_s": t_contig,
                    "nixl_scattered_s": t_scatter,
                    "memcpy_s": t_copy,
                    "nixl_contiguous_gbps": nbytes / t_contig / 1e9,
                    "nixl_scattered_gbps": nbytes / t_scatter / 1e9,
                    "memcpy_gbps": nbytes / t_copy / 1e9,
                    "scattered_descriptors": n_small,
                }
            )
        # the bytes really arrived (the last runs read the largest size)
        big = region_content("big", region_shapes(max(sizes))["big"])
        small = region_content("small", region_shapes(max(sizes))["small"])
        n_small = max(sizes) * MiB // SMALL_UNIT
        if not (
            torch.equal(local["big"], big)
            and torch.equal(local["small"][:n_small].flip(0), small[0 : 2 * n_small : 2])
        ):
            raise RuntimeError("the bytes read differ from the producer's")
        transport.close()
    finally:
        conn.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()

    print(
        f"NIXL READ over UCX on loopback (UCX_TLS={os.environ.get('UCX_TLS', 'default')}), "
        f"median of {args.runs}; handshake {handshake_ms:.1f} ms, first read "
        f"{first_read_ms:.1f} ms (connection set-up); load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(
        f"{'size':>7} | {'NIXL contiguous':>16} | {'NIXL scattered 64K':>18} | "
        f"{'memcpy':>10} | {'contig/memcpy':>13}"
    )
    for r in rows:
        print(
            f"{r['size_mb']:>4} MB | {r['nixl_contiguous_gbps']:>11.2f} GB/s | "
            f"{r['nixl_scattered_gbps']:>13.2f} GB/s | {r['memcpy_gbps']:>5.2f} GB/s | "
            f"{r['nixl_contiguous_gbps'] / r['memcpy_gbps']:>12.0%}"
        )
    os.makedirs(RESULTS, exist_ok=True)
    out = os.path.join(RESULTS, "kv_transfer_bandwidth.json")
    with open(out, "w") as f:
        json.dump(
            {
                "ucx_tls": os.environ.get("UCX_TLS", "default"),
                "runs": args.runs,
                "handshake_ms": handshake_ms,
                "first_read_ms": first_read_ms,
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
                "load_average": os.getloadavg(),
                "rows": rows,
            },
            f,
            indent=2,
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
