"""Leases (KV manager) and lease tokens (signed params), without engines."""

from __future__ import annotations

import json
import time

import pytest

from pdpool.engine.connector import lease_token
from pdpool.engine.connector.lease_token import LeaseToken, LeaseTokenError
from pdpool.engine.connector.load_plan import verified_positions
from pdpool.engine.kv.hashing import BlockHasher, prefix_hash
from pdpool.engine.kv import leases as leases_module
from pdpool.engine.kv.leases import LeaseRefused, LeaseTable, longest_hold_s
from pdpool.engine.kv.manager import KVCacheManager
from pdpool.engine.request import Request
from pdpool.engine.sampling_params import SamplingParams

SECRET = b"s" * 32
BS = 16


def params() -> dict:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_block_ids": [1, 2, 3],
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    }


def token(expires_in_s: float = 60) -> LeaseToken:
    return LeaseToken("L1", "epoch1", 40, b"\x01" * 32, int((time.time() + expires_in_s) * 1000))


def test_signed_params_verify_and_survive_reencoding():
    p = lease_token.attach(params(), token(), SECRET)
    # A router that decodes and re-encodes the object (key order, ints as floats) keeps it.
    routed = json.loads(json.dumps(p, sort_keys=True))
    routed["pdpool_lease"]["num_tokens"] = 40.0
    got = lease_token.read(routed, SECRET)
    assert (got.lease_id, got.epoch, got.num_tokens) == ("L1", "epoch1", 40)


@pytest.mark.parametrize(
    "field,value",
    [
        ("remote_block_ids", [1, 2, 4]),
        ("remote_host", "10.0.0.2"),
        ("remote_port", 5601),
        ("remote_engine_id", "x"),
        ("do_remote_prefill", False),
        ("remote_num_tokens", 3),
    ],
)
def test_any_field_a_consumer_acts_on_is_signed(field, value):
    p = lease_token.attach(params(), token(), SECRET)
    p[field] = value
    with pytest.raises(LeaseTokenError, match="bad signature"):
        lease_token.read(p, SECRET)


@pytest.mark.parametrize(
    "key,value",
    [
        ("id", "L2"),
        ("epoch", "e2"),
        ("num_tokens", 41),
        ("hash", "00" * 32),
        ("expires_ms", 1 << 50),
    ],
)
def test_the_lease_itself_is_signed(key, value):
    p = lease_token.attach(params(), token(), SECRET)
    p["pdpool_lease"][key] = value
    with pytest.raises(LeaseTokenError, match="bad signature"):
        lease_token.read(p, SECRET)


def test_unsigned_other_secret_expired_and_missing_are_refused():
    with pytest.raises(LeaseTokenError, match="unsigned"):
        lease_token.read(lease_token.attach(params(), token(), None), SECRET)
    with pytest.raises(LeaseTokenError, match="bad signature"):
        lease_token.read(lease_token.attach(params(), token(), b"o" * 32), SECRET)
    with pytest.raises(LeaseTokenError, match="expired"):
        lease_token.read(lease_token.attach(params(), token(-10), SECRET), SECRET)
    with pytest.raises(LeaseTokenError, match="no pdpool_lease"):
        lease_token.read(params(), SECRET)
    for bad in (
        {"id": 1},
        {"id": "x", "epoch": "e", "num_tokens": True, "hash": "00", "expires_ms": 1},
        "nope",
    ):
        with pytest.raises(LeaseTokenError):
            lease_token.read({**params(), "pdpool_lease": bad}, None)


def test_secret_sources(tmp_path, monkeypatch):
    monkeypatch.delenv(lease_token.SECRET_ENV, raising=False)
    monkeypatch.delenv(lease_token.SECRET_FILE_ENV, raising=False)
    assert lease_token.load_secret(None) is None
    f = tmp_path / "s"
    f.write_text("abcdefghijklmnopqrstuvwxyz\n")
    assert lease_token.load_secret(str(f)) == b"abcdefghijklmnopqrstuvwxyz"
    monkeypatch.setenv(lease_token.SECRET_FILE_ENV, str(f))
    assert lease_token.load_secret(None) == b"abcdefghijklmnopqrstuvwxyz"
    monkeypatch.delenv(lease_token.SECRET_FILE_ENV)
    monkeypatch.setenv(lease_token.SECRET_ENV, "0123456789abcdef0123")
    assert lease_token.load_secret(None) == b"0123456789abcdef0123"
    monkeypatch.setenv(lease_token.SECRET_ENV, "short")
    with pytest.raises(ValueError, match="too short"):
        lease_token.load_secret(None)
    with pytest.raises(ValueError, match="--kv-secret-file"):
        lease_token.load_secret(str(tmp_path / "missing"))


def request(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), block_size=BS)


def manager_with_blocks(req: Request) -> KVCacheManager:
    kv = KVCacheManager(32, BS)
    assert kv.allocate_slots(req, req.num_tokens)
    return kv


def test_lease_lifecycle_holds_then_gives_back():
    req = request(list(range(3, 43)))
    kv = manager_with_blocks(req)
    leases = LeaseTable("ep", hold_s=5.0, max_read_s=2.0)
    lease = leases.grant_new("L", req, kv.block_tables("r"), 40, BS)
    kv.hold_for_lease("L", kv.blocks_of(req, 40))
    kv.free(req)
    assert kv.pool.num_used_blocks == 3  # held for the lease alone
    opened = leases.open("L", "ep", read_timeout_s=1.0)
    assert opened["hashes"] == [h.hex() for h in req.block_hashes[:2]]
    assert opened["tail_hash"] == prefix_hash(req.all_token_ids, req.block_hashes, 40, BS).hex()
    assert lease.prefix_hash == prefix_hash(req.all_token_ids, req.block_hashes, 40, BS)
    with pytest.raises(LeaseRefused, match="already opened"):
        leases.open("L", "ep", 1.0)  # single use: a replay finds nothing
    assert leases.take_ended() == []  # still pinned for the read
    assert leases.release("L") and not leases.release("L")
    assert [x.lease_id for x in leases.take_ended()] == ["L"]
    assert kv.end_lease_hold("L") and not kv.end_lease_hold("L")
    assert kv.pool.num_used_blocks == 0 and kv.lease_holds() == []


def test_lease_refusals_and_expiry():
    req = request(list(range(3, 43)))
    kv = manager_with_blocks(req)
    leases = LeaseTable("ep", hold_s=5.0, max_read_s=2.0)
    leases.grant_new("L", req, kv.block_tables("r"), 40, BS)
    with pytest.raises(LeaseRefused, match="epoch"):
        leases.open("L", "other-epoch", 1.0)
    with pytest.raises(LeaseRefused, match="no live lease"):
        leases.open("nope", "ep", 1.0)
    assert leases.renew("L", "ep") > 4.0
    ended = leases.take_ended(now=time.monotonic() + 60)
    assert [x.lease_id for x in ended] == ["L"] and leases.counters["leases_expired"] == 1


def test_a_read_opened_as_the_hold_ends_by_a_consumer_that_died_ends_by_the_longest_hold(
    monkeypatch,
):
    clock = [1000.0]
    monkeypatch.setattr(leases_module.time, "monotonic", lambda: clock[0])
    req = request(list(range(3, 43)))
    kv = manager_with_blocks(req)
    leases = LeaseTable("ep", hold_s=10.0, max_read_s=35.0)
    leases.grant_new("L", req, kv.block_tables("r"), 40, BS)
    clock[0] += 9.99  # opened just before the hold ends; no notification ever comes
    leases.open("L", "ep", read_timeout_s=30.0)
    bound = 1000.0 + longest_hold_s(10.0, 30.0, 35.0)
    assert leases.take_ended(now=bound - 0.02) == []  # the read may still be writing
    assert [x.lease_id for x in leases.take_ended(now=bound)] == ["L"]
    # A consumer cannot pin a lease for longer by asking for a longer read.
    leases.grant_new("M", req, kv.block_tables("r"), 40, BS)
    leases.open("M", "ep", read_timeout_s=1e9)
    assert [
        x.lease_id for x in leases.take_ended(now=clock[0] + longest_hold_s(0, 35, 35) + 0.01)
    ] == ["M"]


def lease_view(req: Request, num_tokens: int) -> dict:
    return {
        "num_tokens": num_tokens,
        "hashes": [h.hex() for h in req.block_hashes[: num_tokens // BS]],
        "tail_hash": prefix_hash(req.all_token_ids, req.block_hashes, num_tokens, BS).hex()
        if num_tokens % BS
        else None,
    }


def test_content_check_counts_only_blocks_holding_our_tokens():
    ours = request(list(range(3, 53)))  # 50 tokens: 3 full blocks + 2
    same = lease_view(ours, 50)
    own_tail = prefix_hash(ours.all_token_ids, ours.block_hashes, 50, BS)
    assert verified_positions(0, 4, 49, same, ours.block_hashes, own_tail, BS) == 4
    diverging = request(list(range(3, 35)) + [7] * 18)  # differs from token 32 on
    view = lease_view(diverging, 50)
    assert verified_positions(0, 4, 49, view, ours.block_hashes, own_tail, BS) == 2
    salted = Request(
        "s", list(range(3, 53)), SamplingParams(max_tokens=4), block_size=BS, cache_salt="tenant-b"
    )
    assert (
        verified_positions(0, 4, 49, lease_view(salted, 50), ours.block_hashes, own_tail, BS) == 0
    )
    short = lease_view(ours, 32)  # holds fewer tokens than we need
    assert verified_positions(0, 4, 49, short, ours.block_hashes, own_tail, BS) == 2


def test_hasher_prefix_hash_commits_to_every_token():
    hasher = BlockHasher(BS)
    a = list(range(40))
    b = [*a[:-1], 999]
    ha, hb = hasher.hash_blocks(a, [], 2), hasher.hash_blocks(b, [], 2)
    assert prefix_hash(a, ha, 40, BS) != prefix_hash(b, hb, 40, BS)
    assert prefix_hash(a, ha, 39, BS) == prefix_hash(b, hb, 39, BS)
    assert prefix_hash(a, ha, 32, BS) == ha[1]
