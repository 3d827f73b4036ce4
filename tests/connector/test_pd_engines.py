"""P/D between real engine processes with real NIXL transfers over loopback (CPU DRAM)."""

from __future__ import annotations

import random
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("nixl", reason="the nixl extra is not installed")

from devtools.engine_procs import SpawnedEngine
from tests.support.pd_router import (
    connector_stat,
    decode_leg,
    engine_set,
    post,
    prefill_leg,
    text_of,
    unsigned_lease,
    wait_no_blocks,
)

# Starts engine processes: the full run's tier, not the fast one.
pytestmark = pytest.mark.slow

NIXL = ("--kv-connector", "nixl", "--num-kv-blocks", "256")
BLOCK = 16


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("pd-logs")


@pytest.fixture(scope="module")
def engines(tiny_qwen3, logs):
    """prefill, a second prefill, decode (fast load timeout), a `fail`-policy decode, and a
    plain aggregated engine as the reference."""
    specs = {
        "P": (
            *NIXL,
            "--kv-role",
            "producer",
            "--kv-producer-timeout",
            "3",
            "--kv-pull-threshold",
            "16",
        ),
        "P2": (*NIXL, "--kv-role", "producer"),
        "D": (*NIXL, "--kv-role", "consumer", "--kv-load-timeout", "3"),
        "Dfail": (*NIXL, "--kv-role", "consumer", "--kv-load-failure-policy", "fail"),
        "A": ("--num-kv-blocks", "256"),
    }
    with engine_set(tiny_qwen3, logs, specs) as procs:
        yield procs


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def body(prompt, max_tokens=8) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def block_bytes(eng) -> int:
    """Bytes of one KV block of the engine's model: layers x (K, V) x tokens x KV heads x
    head dim x 4 (float32)."""
    import json

    cfg = json.loads((eng.model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BLOCK * cfg["num_key_value_heads"] * head_dim * 4


@pytest.mark.parametrize("n", [1, 5, 40, 200])
def test_pd_output_equals_one_engine_and_decode_computes_one_token(engines, n):
    P, D, A = engines["P"], engines["D"], engines["A"]
    b = body(prompt_ids(n, seed=n))
    ref = post(A.url, b)
    computed0, bytes0 = D.metric("pdpool_computed_tokens_total"), connector_stat(D, "bytes_read")
    kv = prefill_leg(P.url, b)
    assert len(kv["remote_block_ids"]) == -(-n // BLOCK)
    out = decode_leg(D.url, b, kv)
    assert text_of(out) == text_of(ref)
    # The decode engine computed the last prompt token and the decode steps only.
    assert D.metric("pdpool_computed_tokens_total") - computed0 == b["max_tokens"]
    pulled_blocks = -(-(n - 1) // BLOCK)
    assert connector_stat(D, "bytes_read") - bytes0 == pulled_blocks * block_bytes(D)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    wait_no_blocks(P, D)


def test_n_choices_load_the_prefill_once_and_all_answer(engines):
    """n>1 with a remote prefill: the first choice pulls the prompt's KV, the others start
    once it is in the decode engine's prefix cache; every choice equals one engine's."""
    P, D, A = engines["P"], engines["D"], engines["A"]
    b = body(prompt_ids(100, seed=7))
    ref = post(A.url, {**b, "n": 3})
    bytes0 = connector_stat(D, "bytes_read")
    out = decode_leg(D.url, {**b, "n": 3}, prefill_leg(P.url, b))
    assert [c["text"] for c in out["choices"]] == [c["text"] for c in ref["choices"]]
    # one pull of the prompt's full blocks (the last token is computed here)
    assert connector_stat(D, "bytes_read") - bytes0 == -(-99 // BLOCK) * block_bytes(D)
    wait_no_blocks(P, D)


def test_kv_params_with_several_prompts_or_a_producer_n_are_refused(engines):
    P = engines["P"]
    several = {**body([[5, 6, 7], [8, 9, 10]]), "kv_transfer_params": {"do_remote_prefill": True}}
    r = httpx.post(P.url + "/v1/completions", json=several, timeout=30)
    assert r.status_code == 400 and "kv_transfer_params" in r.text
    producer_n = {**body([5, 6, 7]), "n": 2, "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(P.url + "/v1/completions", json=producer_n, timeout=30)
    assert r.status_code == 400 and "kv_transfer_params" in r.text


def test_decode_pulls_only_what_it_does_not_cache(engines):
    P, D, A = engines["P"], engines["D"], engines["A"]
    prefix = prompt_ids(64, seed=100)  # 4 blocks the decode engine will cache
    post(D.url, body(prefix, 2))
    b = body(prefix + prompt_ids(50, seed=101))  # 114 tokens: blocks 4..7 are missing
    bytes0 = connector_stat(D, "bytes_read")
    out = decode_leg(D.url, b, prefill_leg(P.url, b))
    assert text_of(out) == text_of(post(A.url, b))
    assert connector_stat(D, "bytes_read") - bytes0 == 4 * block_bytes(D)
    wait_no_blocks(P, D)


def test_three_engines_concurrently(engines):
    P, P2, D, A = engines["P"], engines["P2"], engines["D"], engines["A"]
    bodies = [body(prompt_ids(30 + 20 * i, seed=200 + i)) for i in range(6)]

    def flow(i):
        kv = prefill_leg((P if i % 2 else P2).url, bodies[i])
        return text_of(decode_leg(D.url, bodies[i], kv))

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(flow, range(6)))
    assert got == [text_of(post(A.url, b)) for b in bodies]
    wait_no_blocks(P, P2, D)


def test_prefill_killed_before_the_pull(tiny_qwen3, logs, engines):
    D, A = engines["D"], engines["A"]
    victim = SpawnedEngine(tiny_qwen3, logs, *NIXL, "--kv-role", "producer").wait()
    try:
        b = body(prompt_ids(90, seed=300))
        kv = prefill_leg(victim.url, b)
    finally:
        victim.proc.send_signal(signal.SIGKILL)
        victim.stop()
    computed0 = D.metric("pdpool_computed_tokens_total")
    out = decode_leg(D.url, b, kv)
    assert text_of(out) == text_of(post(A.url, b))
    # Nothing arrived: the whole prompt was computed locally.
    assert D.metric("pdpool_computed_tokens_total") - computed0 == 90 + b["max_tokens"] - 1
    wait_no_blocks(D)


@pytest.mark.parametrize(
    "mangle",
    [
        lambda ids: [10_000 + i for i in ids],  # none valid
        lambda ids: [*ids[:2], -1, *ids[3:]],  # one missing
        lambda ids: ids[:3],  # too few ids
        lambda ids: list(reversed(ids)),  # valid ids, wrong blocks
    ],
)
def test_block_ids_in_params_are_not_trusted_the_lease_decides(engines, mangle):
    """Without a secret, tampered block ids change nothing: the consumer reads the blocks
    the producer's lease holds, after checking their hashes against its own prompt."""
    P, D, A = engines["P"], engines["D"], engines["A"]
    b = body(prompt_ids(100, seed=400 + len(str(mangle([1, 2, 3, 4, 5])))))
    kv = prefill_leg(P.url, b)
    kv["remote_block_ids"] = mangle(kv["remote_block_ids"])
    pulled0, computed0 = (
        connector_stat(D, "tokens_pulled"),
        D.metric("pdpool_computed_tokens_total"),
    )
    out = decode_leg(D.url, b, kv)
    assert text_of(out) == text_of(post(A.url, b))
    assert connector_stat(D, "tokens_pulled") - pulled0 == 99
    assert D.metric("pdpool_computed_tokens_total") - computed0 == b["max_tokens"]
    wait_no_blocks(P, D)  # the producer was notified and freed its blocks


def test_malformed_kv_transfer_params_are_a_400(engines):
    D = engines["D"]
    for bad in (
        {"remote_block_ids": ["x"]},
        {"do_remote_prefill": "maybe"},
        {"remote_port": "http"},
    ):
        r = httpx.post(
            f"{D.url}/v1/completions", json={**body([5, 6, 7]), "kv_transfer_params": bad}
        )
        assert r.status_code == 400 and "kv_transfer_params" in r.json()["error"]["message"]


def test_peer_outside_allowlist_is_refused(engines):
    P, D, A = engines["P"], engines["D"], engines["A"]
    b = body(prompt_ids(40, seed=500))
    kv = prefill_leg(P.url, b)
    refused0 = connector_stat(D, "peers_refused")
    out = decode_leg(D.url, b, {**kv, "remote_host": "10.255.255.1"})
    assert text_of(out) == text_of(post(A.url, b))
    assert connector_stat(D, "peers_refused") == refused0 + 1
    assert "not in the KV peer allowlist" in D.log.read_text()
    wait_no_blocks(P, D)  # unread: the producer's timeout frees its blocks


def test_engine_with_other_block_size_is_refused(tiny_qwen3, logs, engines):
    """Another block size is another KV layout: the lease's signed fingerprint differs, so
    it is refused before any connection (its hashes, chained over other blocks, would
    differ too)."""
    D, A = engines["D"], engines["A"]
    other = SpawnedEngine(tiny_qwen3, logs, *NIXL, "--block-size", "8").wait()
    try:
        b = body(prompt_ids(40, seed=600))
        refused0 = connector_stat(D, "params_refused")
        out = decode_leg(D.url, b, prefill_leg(other.url, b))
        assert text_of(out) == text_of(post(A.url, b))
        assert connector_stat(D, "params_refused") == refused0 + 1
        assert "its fingerprint differs" in D.log.read_text()
    finally:
        other.stop()
    wait_no_blocks(D)


def test_producer_timeout_frees_unread_blocks(engines):
    P = engines["P"]
    wait_no_blocks(P)
    prefill_leg(P.url, body(prompt_ids(64, seed=700)))
    assert P.metric("pdpool_kv_blocks_used") == 4
    expired0 = connector_stat(P, "leases_expired")
    wait_no_blocks(P, timeout=10)
    assert connector_stat(P, "leases_expired") == expired0 + 1


def test_fail_policy_fails_cleanly(engines):
    """Under `fail`, params refused on arrival (another prompt's lease) and a lease refused
    by the producer (a replay of params already read) are a 503, never a 200."""
    P, D, Dfail = engines["P"], engines["D"], engines["Dfail"]
    b = body(prompt_ids(60, seed=800))
    kv = prefill_leg(P.url, b)
    other = body(prompt_ids(60, seed=801))
    r = httpx.post(
        f"{Dfail.url}/v1/completions", json={**other, "kv_transfer_params": kv}, timeout=60
    )
    assert r.status_code == 503
    assert "KV transfer refused" in r.json()["error"]["message"]
    decode_leg(D.url, b, kv)  # the honest read ends the lease
    r = httpx.post(f"{Dfail.url}/v1/completions", json={**b, "kv_transfer_params": kv}, timeout=60)
    assert r.status_code == 503
    assert "KV transfer failed" in r.json()["error"]["message"]
    wait_no_blocks(P, D, Dfail)


def test_a_hanging_peer_does_not_delay_other_requests(engines):
    """A 'prefill engine' that accepts the handshake connection and never answers."""
    D, A = engines["D"], engines["A"]
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    conns = []
    threading.Thread(target=lambda: conns.append(srv.accept()), daemon=True).start()
    b = body(prompt_ids(70, seed=900))
    kv = {
        "do_remote_prefill": True,
        "remote_engine_id": "ghost",
        "remote_request_id": "x",
        "remote_block_ids": list(range(5)),
        "remote_host": "127.0.0.1",
        "remote_port": srv.getsockname()[1],
        "tp_size": 1,
        "pdpool_lease": unsigned_lease(b["prompt"]),
    }
    try:
        with ThreadPoolExecutor(1) as pool:
            stuck = pool.submit(decode_leg, D.url, b, kv)
            time.sleep(0.5)
            t = time.monotonic()
            other = post(D.url, body(prompt_ids(20, seed=901), 4))
            other_latency = time.monotonic() - t
            assert other["choices"][0]["finish_reason"] == "length"
            assert not stuck.done()  # still waiting for the lease call
            assert text_of(stuck.result(timeout=60)) == text_of(post(A.url, b))
        # The lease call times out after 5 s; the other request did not wait for it.
        assert other_latency < 4.0
    finally:
        srv.close()
    wait_no_blocks(D)


def test_bidirectional_turn_two_pulls_history_from_decode(engines):
    """Turn 1 runs on the decode engine; turn 2 is rejected there (threshold), its prefill
    pulls the cached history from the decode engine, and decode pulls only the new part."""
    P, D, A = engines["P"], engines["D"], engines["A"]
    turn1 = prompt_ids(96, seed=1000)
    r1 = post(D.url, body(turn1, 8))
    history = turn1 + prompt_ids(8, seed=1001)  # stands in for the assistant's answer
    turn2 = body(history + prompt_ids(60, seed=1002))  # 164 tokens
    rejected = post(D.url, {**turn2, "cache_hit_threshold": 0.9})
    assert rejected["choices"][0]["finish_reason"] == "cache_threshold"
    described = rejected["kv_transfer_params"]
    assert described["do_remote_decode"] is True and described["remote_num_tokens"] == 96
    pulled0, computed0 = (
        connector_stat(P, "tokens_pulled"),
        P.metric("pdpool_computed_tokens_total"),
    )
    kv = prefill_leg(P.url, turn2, {k: v for k, v in described.items() if k != "do_remote_prefill"})
    # The prefill engine pulled the 96-token history and computed only the rest.
    assert connector_stat(P, "tokens_pulled") - pulled0 == 96
    assert P.metric("pdpool_computed_tokens_total") - computed0 == 164 - 96
    bytes0 = connector_stat(D, "bytes_read")
    out = decode_leg(D.url, turn2, kv)
    assert text_of(out) == text_of(post(A.url, turn2))
    # The decode engine already held blocks 0..5 of the history: it read blocks 6..10.
    assert connector_stat(D, "bytes_read") - bytes0 == 5 * block_bytes(D)
    assert r1["choices"][0]["finish_reason"] == "length"
    wait_no_blocks(P, D)
