"""P/D for the hybrid Qwen3.5 model: attention blocks and the recurrent state travel
together over NIXL."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("nixl", reason="the nixl extra is not installed")

from tests.support.pd_router import (
    connector_stat,
    decode_leg,
    engine_set,
    post,
    prefill_leg,
    text_of,
    wait_no_blocks,
)

pytestmark = pytest.mark.slow  # engine processes: the full run's tier

NIXL = ("--kv-connector", "nixl", "--num-kv-blocks", "256")


@pytest.fixture(scope="module")
def engines(tiny_qwen3_5, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-hybrid-logs")
    specs = {
        "P": (*NIXL, "--kv-role", "producer", "--kv-pull-threshold", "16"),
        "D": (*NIXL, "--kv-role", "consumer"),
        "A": ("--num-kv-blocks", "256"),
    }
    with engine_set(tiny_qwen3_5, logs, specs) as procs:
        yield procs


def ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def body(prompt, max_tokens=8):
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("n", [7, 40, 130])
def test_hybrid_pd_equals_one_engine(engines, n):
    P, D, A = engines["P"], engines["D"], engines["A"]
    b = body(ids(n, seed=n))
    kv = prefill_leg(P.url, b)
    assert len(kv["remote_block_ids"]) == 2  # attention group + the state slot
    computed0 = D.metric("pdpool_computed_tokens_total")
    out = decode_leg(D.url, b, kv)
    assert text_of(out) == text_of(post(A.url, b))
    # The decode engine computed the last prompt token and the decode steps only.
    assert D.metric("pdpool_computed_tokens_total") - computed0 == b["max_tokens"]
    wait_no_blocks(P, D)


def test_hybrid_bidirectional_pull(engines):
    P, D, A = engines["P"], engines["D"], engines["A"]
    turn1 = ids(80, seed=1)
    post(D.url, body(turn1, 4))  # decode caches 80 tokens, snapshot at 80 (a decode step)
    turn2 = body(turn1 + ids(70, seed=2))
    rejected = post(D.url, {**turn2, "cache_hit_threshold": 0.9})
    described = rejected["kv_transfer_params"]
    assert rejected["choices"][0]["finish_reason"] == "cache_threshold"
    assert described["remote_num_tokens"] == 80 and len(described["remote_block_ids"]) == 2
    pulled0 = connector_stat(P, "tokens_pulled")
    kv = prefill_leg(P.url, turn2, {k: v for k, v in described.items() if k != "do_remote_prefill"})
    assert connector_stat(P, "tokens_pulled") - pulled0 == 80
    out = decode_leg(D.url, turn2, kv)
    assert text_of(out) == text_of(post(A.url, turn2))
    wait_no_blocks(P, D)


def test_decode_can_hit_a_pulled_prefix_on_the_next_turn(engines):
    """The prefill engine also hands over its snapshot at the last block boundary, so the
    decode engine can resume the next turn of the conversation from it."""
    P, D, A = engines["P"], engines["D"], engines["A"]
    turn1 = body(ids(75, seed=50), 4)
    decode_leg(D.url, turn1, prefill_leg(P.url, turn1))
    turn2 = body(turn1["prompt"] + ids(6, seed=51))
    computed0 = D.metric("pdpool_computed_tokens_total")
    out = post(D.url, {**turn2, "cache_hit_threshold": 0.5})
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert D.metric("pdpool_computed_tokens_total") - computed0 == 81 - 64 + 8 - 1
    assert text_of(out) == text_of(post(A.url, turn2))
    wait_no_blocks(P, D)


def test_hybrid_forged_and_replayed_params_are_refused(engines):
    """The state travels under the same lease as the blocks: another prompt's params, or
    params read once already, load nothing, and the answer is this prompt's own."""
    P, D, A = engines["P"], engines["D"], engines["A"]
    victim = ids(70, seed=90)
    forger = body(ids(69, seed=91) + victim[-1:])
    kv = prefill_leg(P.url, body(victim))
    pulled0 = connector_stat(D, "tokens_pulled")
    assert text_of(decode_leg(D.url, forger, kv)) == text_of(post(A.url, forger))
    assert connector_stat(D, "tokens_pulled") == pulled0
    assert text_of(decode_leg(D.url, body(victim), kv)) == text_of(post(A.url, body(victim)))
    assert connector_stat(D, "tokens_pulled") - pulled0 == 69  # the honest read, blocks and state
    again = body(victim, 5)  # a replay of the read lease
    assert text_of(decode_leg(D.url, again, kv)) == text_of(post(A.url, again))
    assert connector_stat(D, "tokens_pulled") - pulled0 == 69
    wait_no_blocks(P, D)
