"""The engine server -> core transport, measured: CoreChannel (a local socket pair with a
writer and a reader thread of its own at each end, engine/core_channel.py) against ZeroMQ
PUSH/PULL over ipc (what vLLM uses between its API server and EngineCore), both carrying
the same pickled AddRequest messages from one process to another.

    python benchmarks/core_transport.py [--messages 2000] [--prompt-tokens 3000]

Reported per transport and prompt size: messages/s and MB/s until the last one arrived.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import print_table, write_json

from pdpool.engine.core_channel import CoreChannel, decode, encode
from pdpool.engine.core_messages import AddRequest
from pdpool.engine.sampling_params import SamplingParams


def _message(i: int, prompt_tokens: int) -> AddRequest:
    return AddRequest(f"req-{i}", list(range(prompt_tokens)), SamplingParams(max_tokens=16))


def _channel_receiver(conn, count: int, done) -> None:
    got = threading.Event()
    seen = [0]

    def on_messages(msgs: list) -> None:
        seen[0] += len(msgs)
        if seen[0] >= count:
            got.set()

    CoreChannel(conn, on_messages, lambda why: got.set(), "recv").start()
    got.wait()
    done.send(time.perf_counter())


def run_channel(count: int, prompt_tokens: int) -> tuple[float, int]:
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe(duplex=True)
    done_r, done_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_channel_receiver, args=(b, count, done_w))
    proc.start()
    sender = CoreChannel(a, lambda msgs: None, lambda why: None, "send").start()
    msgs = [_message(i, prompt_tokens) for i in range(count)]
    size = len(encode(msgs[0])) * count
    t0 = time.perf_counter()
    for msg in msgs:
        sender.send(msg)
    end = done_r.recv()
    proc.join(10)
    sender.flush_and_close(1.0)
    return end - t0, size


def _zmq_receiver(path: str, count: int, done) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PULL)
    sock.bind(path)
    done.send("bound")
    for _ in range(count):
        decode(sock.recv())
    done.send(time.perf_counter())


def run_zmq(count: int, prompt_tokens: int) -> tuple[float, int]:
    import zmq

    ctx = multiprocessing.get_context("spawn")
    path = f"ipc://{tempfile.mkdtemp()}/core.sock"
    done_r, done_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_zmq_receiver, args=(path, count, done_w))
    proc.start()
    done_r.recv()
    sock = zmq.Context().socket(zmq.PUSH)
    sock.connect(path)
    msgs = [_message(i, prompt_tokens) for i in range(count)]
    size = len(encode(msgs[0])) * count
    t0 = time.perf_counter()
    for msg in msgs:
        sock.send(encode(msg), copy=False)
    end = done_r.recv()
    proc.join(10)
    sock.close(linger=0)
    return end - t0, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for prompt_tokens in (16, 3000, 100_000):
        count = args.messages if prompt_tokens < 100_000 else max(20, args.messages // 50)
        for name, run in (("CoreChannel", run_channel), ("zmq PUSH/PULL ipc", run_zmq)):
            best = min((run(count, prompt_tokens) for _ in range(args.rounds)), key=lambda r: r[0])
            seconds, size = best
            rows.append(
                {
                    "transport": name,
                    "prompt_tokens": prompt_tokens,
                    "messages": count,
                    "msgs_per_s": round(count / seconds),
                    "MB_per_s": round(size / seconds / 1e6, 1),
                }
            )
    print_table(rows, "server -> core: pickled AddRequest messages, best of rounds")
    print(write_json("core_transport", {"rows": rows, "args": vars(args)}))


if __name__ == "__main__":
    main()
