"""The sidecar's own overhead: latency it adds over calling the decode engine directly.

    python benchmarks/sidecar_overhead.py                      # fast stand-in upstream
    python benchmarks/sidecar_overhead.py --engine             # a real `pdpool serve`

64 concurrent streaming clients (keep-alive, one connection each) send requests first
straight to the upstream, then through `pdpool sidecar` (decode-first, threshold 0: the
hot path that inspects the first chunk and then streams through), in alternating rounds.
Reported: time to first token and end-to-end latency p50/p99 for both, and the difference.

The default upstream is a STAND-IN that imitates a vLLM SSE stream (fixed tokens at a fixed
pace), so that what is measured is the sidecar and not the engine's batching noise. The
load generator is a minimal HTTP/1.1 client on raw asyncio streams for the same reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pdpool.sidecar.topology import ensure_tiny_model, free_port, healthy, pdpool_command

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ----------------------------------------------------------------------- stand-in upstream
async def serve_standin(port: int, tokens: int, token_interval_s: float) -> None:
    """STAND-IN for a vLLM server: answers every POST with an SSE stream of `tokens`
    completion chunks, one every `token_interval_s`, and /health with 200."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if length:
                    await reader.readexactly(length)
                if head.startswith(b"GET /health"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                    await writer.drain()
                    continue
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                for i in range(tokens):
                    finish = '"length"' if i == tokens - 1 else "null"
                    event = (
                        'data: {"id":"cmpl-x","object":"text_completion","model":"m",'
                        f'"choices":[{{"index":0,"text":" t{i}","finish_reason":{finish}}}]}}'
                        "\n\n"
                    ).encode()
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                    if i < tokens - 1:
                        await asyncio.sleep(token_interval_s)
                done = b"data: [DONE]\n\n"
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# ----------------------------------------------------------------------- load generator
class Conn:
    """One keep-alive HTTP/1.1 connection that sends streaming POSTs."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def post_stream(self, path: str, body: bytes) -> tuple[float, float]:
        """Returns (time to first data byte, total time) in seconds."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        start = time.perf_counter()
        self.writer.write(
            b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), len(body), body)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.decode(errors="replace"))
        first = None
        chunked = b"chunked" in head.lower()
        if not chunked:
            raise RuntimeError("expected a chunked stream")
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
            data = await self.reader.readexactly(size + 2)
            if first is None and size:
                first = time.perf_counter() - start
            if size == 0:
                break
            del data
        return first, time.perf_counter() - start


async def run_round(
    host: str, port: int, concurrency: int, per_client: int, body: bytes
) -> tuple[list[float], list[float]]:
    ttfts, totals = [], []
    conns = [Conn(host, port) for _ in range(concurrency)]

    async def client(conn: Conn) -> None:
        for _ in range(per_client):
            first, total = await conn.post_stream("/v1/completions", body)
            ttfts.append(first)
            totals.append(total)

    await asyncio.gather(*(client(c) for c in conns))
    for c in conns:
        c.writer.close()
    return ttfts, totals


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


# ----------------------------------------------------------------------- main
def wait_healthy(url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not healthy(url):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy")
        time.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", action="store_true", help="a real `pdpool serve` upstream")
    ap.add_argument("--model", help="engine checkpoint (default: the tiny model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument(
        "--token-interval-ms",
        type=float,
        default=20.0,
        help="stand-in pace: a GPU decode step at batch 64 takes about 20 ms",
    )
    ap.add_argument(
        "--sidecar-nice",
        type=int,
        default=0,
        help="niceness of the sidecar (negative: give it CPU first, as a pod "
        "with its own CPU request would have it; needs root)",
    )
    ap.add_argument("--serve-standin", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_standin:
        asyncio.run(serve_standin(args.serve_standin, args.tokens, args.token_interval_ms / 1e3))
        return 0

    procs = []
    up_port, side_port = free_port(), free_port()
    try:
        if args.engine:
            model = args.model or ensure_tiny_model("qwen3")
            procs.append(
                subprocess.Popen(
                    pdpool_command(
                        "serve",
                        model,
                        "--port",
                        str(up_port),
                        "--device",
                        args.device,
                        "--log-level",
                        "warning",
                        "--max-num-seqs",
                        str(max(args.concurrency, 64)),
                    ),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            prompt = {
                "prompt": "benchmark prompt " * 8,
                "max_tokens": args.tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
        else:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        "--serve-standin",
                        str(up_port),
                        "--tokens",
                        str(args.tokens),
                        "--token-interval-ms",
                        str(args.token_interval_ms),
                    ]
                )
            )
            prompt = {"prompt": "benchmark prompt " * 8, "max_tokens": args.tokens}
        procs.append(
            subprocess.Popen(
                pdpool_command(
                    "sidecar",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(side_port),
                    "--decode-url",
                    f"http://127.0.0.1:{up_port}",
                    "--mode",
                    "decode-first",
                    "--cache-hit-threshold",
                    "0",
                )
            )
        )
        if args.sidecar_nice:
            os.setpriority(os.PRIO_PROCESS, procs[-1].pid, args.sidecar_nice)
        wait_healthy(f"http://127.0.0.1:{up_port}")
        wait_healthy(f"http://127.0.0.1:{side_port}")
        body = json.dumps({**prompt, "stream": True}).encode()
        # warm-up: connections, caches, lazy imports
        for port in (up_port, side_port):
            asyncio.run(run_round("127.0.0.1", port, args.concurrency, 1, body))
        data = {"direct": ([], []), "sidecar": ([], [])}
        sidecar_cpu = 0.0
        for _ in range(args.rounds):
            for name, port in (("direct", up_port), ("sidecar", side_port)):
                cpu_before = cpu_seconds(procs[1].pid)
                t, e = asyncio.run(
                    run_round("127.0.0.1", port, args.concurrency, args.requests_per_client, body)
                )
                if name == "sidecar":
                    sidecar_cpu += cpu_seconds(procs[1].pid) - cpu_before
                data[name][0].extend(t)
                data[name][1].extend(e)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)

    rows = {}
    for name, (ttft, total) in data.items():
        rows[name] = {
            "n": len(ttft),
            "ttft_p50_ms": pct(ttft, 0.5) * 1e3,
            "ttft_p99_ms": pct(ttft, 0.99) * 1e3,
            "e2e_p50_ms": pct(total, 0.5) * 1e3,
            "e2e_p99_ms": pct(total, 0.99) * 1e3,
            "e2e_mean_ms": statistics.mean(total) * 1e3,
        }
    added = {
        k: rows["sidecar"][k] - rows["direct"][k]
        for k in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms")
    }
    upstream = (
        "engine (pdpool serve, " + args.device + ")"
        if args.engine
        else f"stand-in ({args.tokens} tokens, {args.token_interval_ms} ms apart)"
    )
    print(
        f"sidecar overhead: {args.concurrency} concurrent streams, upstream = {upstream}, "
        f"{os.cpu_count()} CPUs, sidecar nice {args.sidecar_nice}"
    )
    print(f"{'path':<10}{'n':>6}{'TTFT p50':>11}{'TTFT p99':>11}{'E2E p50':>11}{'E2E p99':>11}")
    for name, r in rows.items():
        print(
            f"{name:<10}{r['n']:>6}{r['ttft_p50_ms']:>9.2f}ms{r['ttft_p99_ms']:>9.2f}ms"
            f"{r['e2e_p50_ms']:>9.2f}ms{r['e2e_p99_ms']:>9.2f}ms"
        )
    cpu_ms = sidecar_cpu * 1e3 / max(rows["sidecar"]["n"], 1)
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(
        f"{'added':<10}{'':>6}{added['ttft_p50_ms']:>9.2f}ms{added['ttft_p99_ms']:>9.2f}ms"
        f"{added['e2e_p50_ms']:>9.2f}ms{added['e2e_p99_ms']:>9.2f}ms"
    )
    print(
        f"sidecar CPU per streamed request: {cpu_ms:.3f} ms "
        f"({args.tokens + 1} SSE events each); machine load average {load:.1f}"
    )
    os.makedirs(RESULTS, exist_ok=True)
    out = os.path.join(RESULTS, "sidecar_overhead" + ("_engine" if args.engine else "") + ".json")
    with open(out, "w") as fh:
        json.dump(
            {
                "concurrency": args.concurrency,
                "upstream": upstream,
                "cpus": os.cpu_count(),
                "load_average": load,
                "sidecar_nice": args.sidecar_nice,
                "sidecar_cpu_ms_per_request": cpu_ms,
                "rows": rows,
                "added": added,
            },
            fh,
            indent=2,
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
