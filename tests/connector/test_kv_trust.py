"""The KV handoff fails closed, on real engine processes over real NIXL (loopback).

Every case ends in the single engine's text (or a clear error), never in another
request's text with HTTP 200; and nothing stays held afterwards.
"""

from __future__ import annotations

import copy
import random
import threading
import time

import httpx
import pytest

pytest.importorskip("nixl", reason="the nixl extra is not installed")

from benchmarks.proc_cpu import cpu_seconds_of
from devtools.engine_procs import SpawnedEngine, free_port
from tests.support.pd_router import (
    connector_stat,
    decode_leg,
    engine_set,
    post,
    prefill_leg,
    text_of,
    unsigned_lease,
)

# Starts engine processes: the full run's tier, not the fast one.
pytestmark = pytest.mark.slow

NIXL = ("--kv-connector", "nixl", "--num-kv-blocks", "64")
HOLD_S = 1.5


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def body(prompt, max_tokens=8) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("trust-logs")


@pytest.fixture(scope="module")
def secrets(logs):
    out = {}
    for name in ("pool", "other"):
        path = logs / f"{name}.secret"
        path.write_text(f"{name}-secret-" + "x" * 32)
        out[name] = str(path)
    return out


@pytest.fixture(scope="module")
def engines(tiny_qwen3, logs, secrets):
    """Ps: a signing producer with a short hold; Ds: a consumer of the same pool; Dn: a
    consumer without a secret (content checks only); Dx: a consumer of another pool; P: an
    unsigned producer; A: the single-engine reference."""
    pool, other = ("--kv-secret-file", secrets["pool"]), ("--kv-secret-file", secrets["other"])
    specs = {
        "Ps": (*NIXL, "--kv-role", "producer", "--kv-producer-timeout", str(HOLD_S), *pool),
        "Ds": (*NIXL, "--kv-role", "consumer", "--max-num-seqs", "1", *pool),
        "Dn": (*NIXL, "--kv-role", "consumer", "--kv-producer-timeout", "60"),
        "Dx": (*NIXL, "--kv-role", "consumer", *other),
        "P": (*NIXL, "--kv-role", "producer", "--kv-producer-timeout", "30"),
        "A": ("--num-kv-blocks", "64"),
    }
    with engine_set(tiny_qwen3, logs, specs) as procs:
        yield procs


def wait_idle(*engs, timeout: float = 15.0) -> None:
    """No block in use and no lease held on any of them."""
    deadline = time.monotonic() + timeout
    while True:
        held = {
            e.url: (e.metric("pdpool_kv_blocks_used"), connector_stat(e, "leases_active"))
            for e in engs
        }
        if all(v == (0, 0) for v in held.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"still held (blocks, leases): {held}")
        time.sleep(0.2)


def pdpool_usage(resp: dict) -> dict:
    return resp["usage"]["prompt_tokens_details"]["pdpool"]


def test_signed_handoff_loads_and_reports_its_sources(engines):
    Ps, Ds, A = engines["Ps"], engines["Ds"], engines["A"]
    b = body(ids(70, seed=1))
    kv = prefill_leg(Ps.url, b)
    assert kv["pdpool_lease"]["sig"] and kv["pdpool_lease"]["num_tokens"] == 70
    out = decode_leg(Ds.url, b, kv)
    assert text_of(out) == text_of(post(A.url, b))
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 69
    assert pdpool_usage(out) == {"local": 0, "pulled": 69, "computed": 1}
    wait_idle(Ps, Ds)


def test_late_decode_leg_after_expiry_and_reuse_recomputes(engines):
    Ps, Ds, A = engines["Ps"], engines["Ds"], engines["A"]
    b = body(ids(100, seed=2))
    kv = prefill_leg(Ps.url, b)
    time.sleep(HOLD_S + 1.0)
    for k in range(8):  # other traffic takes the freed blocks
        post(Ps.url, body(ids(100, seed=200 + k), 1))
    pulled0 = connector_stat(Ds, "tokens_pulled")
    out = decode_leg(Ds.url, b, kv)
    assert text_of(out) == text_of(post(A.url, b))
    assert connector_stat(Ds, "tokens_pulled") == pulled0
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert pdpool_usage(out)["computed"] == 100
    log = Ds.log.read_text()
    assert "no live lease" in log or "expired" in log
    wait_idle(Ps, Ds)


def test_forged_params_never_return_the_victims_text(engines):
    """A forger sends its own prompt (sharing only the last token with the victim's) with
    the victim's params, then with unsigned and re-pointed ones; it always gets its own
    prompt's text, and the consumer's prefix cache stays clean for honest requests."""
    P, Ps, Ds, Dn, A = (engines[k] for k in ("P", "Ps", "Ds", "Dn", "A"))
    victim = ids(80, seed=3)
    forger = ids(79, seed=4) + victim[-1:]
    vb, fb = body(victim), body(forger)
    victim_text, forger_text = text_of(post(A.url, vb)), text_of(post(A.url, fb))
    assert victim_text != forger_text
    for producer, consumer in ((Ps, Ds), (P, Dn)):
        kv = prefill_leg(producer.url, vb)
        attempts = [kv]
        unsigned = copy.deepcopy(kv)
        unsigned["pdpool_lease"] = unsigned_lease(
            forger, lease_id=kv["pdpool_lease"]["id"], epoch=kv["pdpool_lease"]["epoch"]
        )
        attempts.append(unsigned)
        for params in attempts:
            pulled0 = connector_stat(consumer, "tokens_pulled")
            out = decode_leg(consumer.url, fb, params)
            assert text_of(out) == forger_text
            assert connector_stat(consumer, "tokens_pulled") == pulled0
        honest = decode_leg(consumer.url, vb, kv)  # the lease is still live and unread
        assert text_of(honest) == victim_text
        again = post(consumer.url, fb)  # the forger's prompt, from the cache
        assert text_of(again) == forger_text
    wait_idle(P, Ps, Ds, Dn)


@pytest.mark.parametrize(
    "tamper", ["replay", "hash", "epoch", "lease_id", "host", "expired", "unsigned", "other_pool"]
)
def test_refused_params_recompute_and_leave_nothing_held(engines, tamper):
    Ps, Ds, Dx, A = engines["Ps"], engines["Ds"], engines["Dx"], engines["A"]
    b = body(ids(50, seed=10 + len(tamper)))
    kv = prefill_leg(Ps.url, b)
    consumer = Dx if tamper == "other_pool" else Ds
    lease = kv["pdpool_lease"]
    if tamper == "replay":
        decode_leg(Ds.url, b, kv)  # the honest read ends the lease
    elif tamper == "hash":
        lease["hash"] = "00" * 32
    elif tamper == "epoch":
        lease["epoch"] = "0" * 32
    elif tamper == "lease_id":
        lease["id"] = "guessed"
    elif tamper == "host":
        kv["remote_port"] = kv["remote_port"] + 1
    elif tamper == "expired":
        lease["expires_ms"] = int(time.time() * 1000) - 60_000
    elif tamper == "unsigned":
        del lease["sig"]
    pulled0, refused0 = (
        connector_stat(consumer, "tokens_pulled"),
        connector_stat(consumer, "params_refused"),
    )
    out = decode_leg(consumer.url, b, kv)
    assert text_of(out) == text_of(post(A.url, b))
    assert connector_stat(consumer, "tokens_pulled") == pulled0
    assert pdpool_usage(out)["pulled"] == 0
    if tamper != "replay":  # refused on arrival, before any connection
        assert connector_stat(consumer, "params_refused") == refused0 + 1
    # The unread lease is released by the refusing consumer or expires within the hold.
    wait_idle(Ps, Ds, Dx, timeout=HOLD_S + 10)


def test_a_queued_consumer_keeps_its_lease_alive(engines):
    """Ds runs one request at a time: the decode leg waits behind long requests for longer
    than the producer's hold, renewing the lease, and still loads."""
    Ps, Ds, A = engines["Ps"], engines["Ds"], engines["A"]
    b = body(ids(60, seed=20))
    # Enough work queued ahead of it, one request at a time, to outlast the hold.
    outcomes: list[str] = []

    def blocker(k: int) -> None:
        try:
            post(Ds.url, body(ids(10, seed=21 + k), 400))
            outcomes.append("ok")
        except Exception as exc:  # reported by the assertions below
            outcomes.append(repr(exc))

    blockers = [threading.Thread(target=blocker, args=(k,)) for k in range(8)]
    for thread in blockers:
        thread.start()
    deadline = time.monotonic() + 30
    while Ds.metric("pdpool_num_requests_waiting") < 4:
        assert time.monotonic() < deadline and len(outcomes) < 8, f"never queued: {outcomes}"
        time.sleep(0.02)
    kv = prefill_leg(Ps.url, b)
    pulled0 = connector_stat(Ds, "tokens_pulled")
    t = time.monotonic()
    out = decode_leg(Ds.url, b, kv)
    waited = time.monotonic() - t
    for thread in blockers:
        thread.join()
    assert outcomes == ["ok"] * 8, outcomes
    assert waited > HOLD_S, f"the decode leg did not wait ({waited:.2f} s): the test proves nothing"
    assert text_of(out) == text_of(post(A.url, b))
    assert connector_stat(Ds, "tokens_pulled") - pulled0 == 59
    assert connector_stat(Ps, "leases_renewed") >= 1
    wait_idle(Ps, Ds)


def test_a_rejection_lease_is_released_explicitly(engines):
    """A decode rejection describes its cached prefix under a lease; the router releases it
    at once when the prefill leg does not pull it."""
    Dn = engines["Dn"]
    turn1 = ids(64, seed=30)
    post(Dn.url, body(turn1, 4))
    rejected = post(Dn.url, {**body(turn1 + ids(100, seed=31)), "cache_hit_threshold": 0.9})
    params = rejected["kv_transfer_params"]
    assert rejected["choices"][0]["finish_reason"] == "cache_threshold"
    assert params["remote_num_tokens"] == 64 and connector_stat(Dn, "leases_active") == 1
    r = httpx.post(f"{Dn.url}/pdpool/v1/kv/release", json={"kv_transfer_params": params})
    assert r.status_code == 200 and r.json() == {"released": True}
    wait_idle(Dn, timeout=2)  # long before the 60 s hold
    r = httpx.post(f"{Dn.url}/pdpool/v1/kv/release", json={"kv_transfer_params": params})
    assert r.json() == {"released": False}
    assert httpx.post(f"{Dn.url}/pdpool/v1/kv/release", json={}).status_code == 400


def test_a_restarted_producer_heals_at_once(tiny_qwen3, logs, engines):
    Ds, A = engines["Ds"], engines["A"]
    secret = next(a for a in engines["Ds"].proc.args if a.endswith(".secret"))
    port, kv_port = free_port(), free_port()
    flags = (*NIXL, "--kv-role", "producer", "--kv-port", str(kv_port), "--kv-secret-file", secret)
    b1, b2, b3 = body(ids(70, seed=40)), body(ids(70, seed=41)), body(ids(70, seed=42))
    first = SpawnedEngine(tiny_qwen3, logs, *flags, port=port).wait()
    try:
        decode_leg(Ds.url, b1, prefill_leg(first.url, b1))  # Ds now knows its agent
        stale = prefill_leg(first.url, b2)
    finally:
        first.stop()
    t_restart = time.monotonic()
    second = SpawnedEngine(tiny_qwen3, logs, *flags, port=port).wait()
    try:
        # Params of the dead engine: refused (other epoch), recomputed, still right.
        assert text_of(decode_leg(Ds.url, b2, stale)) == text_of(post(A.url, b2))
        pulled0 = connector_stat(Ds, "tokens_pulled")
        out = decode_leg(Ds.url, b3, prefill_leg(second.url, b3))
        healed_s = time.monotonic() - t_restart
        assert text_of(out) == text_of(post(A.url, b3))
        assert connector_stat(Ds, "tokens_pulled") - pulled0 == 69
        assert connector_stat(Ds, "peers_replaced") >= 1
        print(f"\nrestart -> first successful read: {healed_s:.1f} s (engine start included)")
        wait_idle(second, Ds)
    finally:
        second.stop()


def test_hostile_lease_ops_are_answered_and_harmless(engines):
    """Garbage on the handshake port (the lease channel) gets a refusal or a closed
    connection; the producer keeps serving honest handoffs."""
    import socket
    import struct

    from pdpool.engine.connector.handshake import LEASE_MAGIC, lease_call

    P, Dn, A = engines["P"], engines["Dn"], engines["A"]
    b = body(ids(40, seed=50))
    kv = prefill_leg(P.url, b)
    port = kv["remote_port"]
    for message in (
        {"op": "open"},
        {"op": "open", "lease_id": 1, "epoch": []},
        {"op": "open", "lease_id": kv["pdpool_lease"]["id"], "epoch": "x"},
        {"op": "renew", "lease_id": "x" * 10_000, "epoch": "y"},
        {"op": "drop-tables", "lease_id": "a", "epoch": "b"},
        {"op": "open", "lease_id": "a", "epoch": "b", "read_timeout_s": "NaN"},
    ):
        reply = lease_call("127.0.0.1", port, message)
        assert reply["ok"] is False and reply["error"]
    for raw in (
        LEASE_MAGIC + struct.pack(">I", 5) + b"[1,2]",
        LEASE_MAGIC + struct.pack(">I", 3) + b"\xff\xfe\xfd",
        LEASE_MAGIC + struct.pack(">I", 1 << 30),
        b"GET / HTTP/1.1\r\n\r\n",
        b"",
    ):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.settimeout(5)
            try:
                sock.sendall(raw)
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(65536):
                    pass
            except (ConnectionResetError, BrokenPipeError, OSError) as exc:
                # The producer may drop a hostile connection before it has all been sent;
                # a hang would show as a timeout instead.
                assert not isinstance(exc, socket.timeout), "the producer kept the connection"
    out = decode_leg(Dn.url, b, kv)  # the lease survived all of that
    assert text_of(out) == text_of(post(A.url, b)) and pdpool_usage(out)["pulled"] == 39
    wait_idle(P, Dn)


def cpu_seconds(pid: int) -> float:
    return cpu_seconds_of(f"/proc/{pid}/stat")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/stat"), reason="needs /proc")
def test_idle_engines_with_nixl_do_not_spin(engines):
    """With nothing to move, a NIXL engine sleeps: no progress thread polling a core."""
    nixl = [e for name, e in engines.items() if name != "A"]
    wait_idle(*nixl)
    before = [cpu_seconds(e.proc.pid) for e in nixl]
    time.sleep(3.0)
    used = [cpu_seconds(e.proc.pid) - b for e, b in zip(nixl, before, strict=True)]
    assert max(used) < 0.5, f"CPU seconds used in 3 s idle, per engine: {used}"
