"""Fault injection: multi-turn chats through `pdpool up` while engines die, restart and freeze.

Concurrent conversations (streamed chat, one turn after another, each turn carrying the
history) run through the gateway of a `--prefill 2 --decode 2` topology while a schedule
of faults plays out: a decode engine killed (and restarted by the supervisor, as
`pdpool up` does), a prefill engine frozen (SIGSTOP) and resumed (SIGCONT), a decode engine
frozen and resumed, a prefill engine killed, a sidecar killed. The goal: no failed request
while at least one path can serve.

Reports requests sent / served / failed, latency percentiles, per fault the time until
the routers ejected the sick endpoint and the time until it served again, and the KV
blocks the engines still hold once idle (a leak would show here).

    python benchmarks/fault_injection.py                # about two minutes on 2 cores
    python benchmarks/fault_injection.py --conversations 8 --gap-s 10
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, write_json

from pdpool.up.topology import Topology, TopologySpec, ensure_tiny_model

WORDS = (
    "river stone cloud lantern harbor meadow copper violet orchard signal ember "
    "compass willow summit thunder canyon"
).split()


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        text = httpx.get(url + "/metrics", timeout=3).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def pct(values, q):
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)] if values else float("nan")


class Load:
    """Conversations in threads; every turn is one streamed chat request."""

    def __init__(self, url: str, model: str, args) -> None:
        self.url, self.model, self.args = url, model, args
        self.records: list[dict] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def turn(self, client: httpx.Client, messages: list[dict]) -> tuple[dict, str]:
        t0 = time.monotonic()
        rec = {"t": t0, "ok": False, "error": None}
        text = []
        try:
            with client.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "model": self.model,
                    "messages": messages,
                    "stream": True,
                    "max_tokens": self.args.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream_options": {"include_usage": True},
                },
            ) as r:
                if r.status_code != 200:
                    rec["error"] = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                else:
                    done, usage = False, None
                    for line in r.iter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            data = json.loads(line[6:])
                            if "error" in data:
                                rec["error"] = str(data["error"])[:200]
                            usage = data.get("usage") or usage
                            for c in data.get("choices") or []:
                                text.append((c.get("delta") or {}).get("content") or "")
                    ok_usage = usage and usage["completion_tokens"] == self.args.max_tokens
                    rec["ok"] = done and not rec["error"] and bool(ok_usage)
                    if not rec["ok"] and not rec["error"]:
                        rec["error"] = f"incomplete stream (done={done}, usage={usage})"
        except httpx.HTTPError as exc:
            rec["error"] = repr(exc)
        rec["latency_s"] = time.monotonic() - t0
        with self.lock:
            self.records.append(rec)
        return rec, "".join(text)

    def conversation(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=300) as client:
            while not self.stop.is_set():
                messages = [
                    {"role": "system", "content": f"Conversation {i}. " + " ".join(WORDS) * 3}
                ]
                for t in range(self.args.turns):
                    if self.stop.is_set():
                        return
                    words = " ".join(WORDS[(i + t + k) % len(WORDS)] for k in range(12))
                    messages.append({"role": "user", "content": f"turn {t}: {words}"})
                    _rec, answer = self.turn(client, messages)
                    messages.append({"role": "assistant", "content": answer or "(none)"})
                    time.sleep(self.args.think_s)


def ejected_anywhere(topo: Topology, endpoint: str, role: str) -> bool:
    """Whether the routers in front of `endpoint` have it ejected."""
    if role == "prefill":
        return any(
            scrape(s.url).get(f'pdpool_sidecar_prefill_ejected{{endpoint="{endpoint}"}}') == 1.0
            for s in topo.by_role("sidecar")
        )
    return (
        scrape(topo.gateway.url).get(f'pdpool_gateway_backend_ejected{{backend="{endpoint}"}}')
        == 1.0
    )


def fault_schedule(topo: Topology) -> list[tuple[str, str, object, str]]:
    """(name, action, child, endpoint the routers eject)."""
    p0, p1 = topo.by_role("prefill")
    d0, d1 = topo.by_role("decode")
    s0, s1 = topo.by_role("sidecar")
    side = {d.name: s for d, s in ((d0, s0), (d1, s1))}
    return [
        ("kill decode-0", "kill", d0, f"127.0.0.1:{side[d0.name].port}"),
        ("freeze prefill-0", "stop", p0, f"127.0.0.1:{p0.port}"),
        ("freeze decode-1", "stop", d1, f"127.0.0.1:{side[d1.name].port}"),
        ("kill prefill-1", "kill", p1, f"127.0.0.1:{p1.port}"),
        ("kill sidecar-0", "kill", s0, f"127.0.0.1:{s0.port}"),
    ]


def run_faults(topo: Topology, load: Load, args) -> list[dict]:
    rows = []
    for name, action, child, endpoint in fault_schedule(topo):
        time.sleep(args.gap_s)
        role = "prefill" if child.role == "prefill" else "decode"
        t0 = time.monotonic()
        os.kill(child.pid, signal.SIGKILL if action == "kill" else signal.SIGSTOP)
        detect = None
        while time.monotonic() - t0 < args.fault_s:
            if detect is None and ejected_anywhere(topo, endpoint, role):
                detect = time.monotonic() - t0
            if action == "kill":
                topo.supervise_once()  # what `pdpool up` does: start it again
            time.sleep(0.2)
        if action == "stop":
            os.kill(child.pid, signal.SIGCONT)
        cleared = time.monotonic()
        recovered = None
        while time.monotonic() - cleared < 120:
            topo.supervise_once()
            if child.proc.poll() is None and not ejected_anywhere(topo, endpoint, role):
                try:
                    ok = httpx.get(child.url + "/health", timeout=1).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    recovered = time.monotonic() - cleared
                    break
            time.sleep(0.2)
        during = [r for r in load.records if r["t"] >= t0 - 1]
        rows.append(
            {
                "fault": name,
                "held_s": args.fault_s if action == "stop" else 0.0,
                "ejected_after_s": detect,
                "serving_again_s": recovered,
                "requests_after": len(during),
                "failed_after": sum(not r["ok"] for r in during),
            }
        )
        print(
            f"  {name}: ejected after {detect}s, serving again {recovered}s after "
            f"{'SIGCONT' if action == 'stop' else 'the kill (restart included)'}",
            flush=True,
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint (default: the tiny model)")
    ap.add_argument("--arch", default="qwen3")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4, help="turns before a conversation starts over")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--think-s", type=float, default=0.2, help="pause between turns")
    ap.add_argument("--gap-s", type=float, default=6.0, help="quiet time before each fault")
    ap.add_argument(
        "--fault-s",
        type=float,
        default=6.0,
        help="how long a frozen engine stays frozen (kills: time watched)",
    )
    ap.add_argument("--kv-blocks", type=int, default=512)
    args = ap.parse_args()

    model_dir = args.model or ensure_tiny_model(args.arch)
    spec = TopologySpec(
        model=model_dir,
        prefill=2,
        decode=2,
        port=0,  # the command line's decode retry (30 s): restarts are ridden out
        engine_args=["--max-model-len", "2048", "--num-kv-blocks", str(args.kv_blocks)],
    )
    with Topology(spec) as topo:
        model = httpx.get(topo.gateway.url + "/v1/models").json()["data"][0]["id"]
        load = Load(topo.gateway.url, model, args)
        threads = [
            threading.Thread(target=load.conversation, args=(i,), daemon=True)
            for i in range(args.conversations)
        ]
        started = time.monotonic()
        for t in threads:
            t.start()
        faults = run_faults(topo, load, args)
        time.sleep(args.gap_s)
        load.stop.set()
        for t in threads:
            t.join(300)
        wall = time.monotonic() - started
        time.sleep(3.0)  # idle: finished requests have given their blocks back
        engines = topo.by_role("prefill") + topo.by_role("decode")
        idle = {c.name: scrape(c.url) for c in engines}
        gw = scrape(topo.gateway.url)
        sidecars = [scrape(s.url) for s in topo.by_role("sidecar")]
        restarts = {c.name: c.restarts for c in topo.children if c.restarts}

    recs = load.records
    lat = [r["latency_s"] for r in recs if r["ok"]]
    summary = {
        "conversations": args.conversations,
        "wall_s": wall,
        "sent": len(recs),
        "served": sum(r["ok"] for r in recs),
        "failed": sum(not r["ok"] for r in recs),
        "p50_s": pct(lat, 0.5),
        "p99_s": pct(lat, 0.99),
        "max_s": max(lat) if lat else None,
        "migrations": gw.get('pdpool_gateway_migrations_total{outcome="ok"}', 0.0),
        "gw_ejections": gw.get("pdpool_gateway_ejections_total", 0.0),
        "prefill_ejections": sum(
            s.get("pdpool_sidecar_prefill_ejections_total", 0.0) for s in sidecars
        ),
        "kv_blocks_held_idle": sum(m.get("pdpool_kv_blocks_used", 0.0) for m in idle.values()),
    }
    kv_rows = [
        {
            "engine": name,
            "kv_blocks_used": m.get("pdpool_kv_blocks_used"),
            "running": m.get("pdpool_num_requests_running"),
            "waiting": m.get("pdpool_num_requests_waiting"),
        }
        for name, m in idle.items()
    ]
    print_table(
        [summary],
        f"fault injection: {args.conversations} conversations, streamed chat, "
        f"{args.max_tokens} tokens per turn, prefill 2 + decode 2",
    )
    print_table(faults, "faults")
    print_table(kv_rows, "engines at idle afterwards")
    errors = [r["error"] for r in recs if not r["ok"]]
    if errors:
        print("\nfailures:", *errors[:10], sep="\n  ")
    write_json(
        "fault_injection",
        {
            "args": vars(args),
            "summary": summary,
            "faults": faults,
            "idle_engines": kv_rows,
            "restarts": restarts,
            "errors": errors[:50],
        },
    )
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
