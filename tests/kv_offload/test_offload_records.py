"""The offload tier's pure parts and its file store: keys, fingerprints, the record format
and its checks, atomic writes and the byte bound."""

from __future__ import annotations

import os

import pytest

from pdpool.engine.kv.offload.keys import KIND_KV, KIND_STATE, block_key, kv_fingerprint
from pdpool.engine.kv.offload.record import (
    DIGEST_BYTES,
    MAX_ENTRIES,
    MAX_RECORD_BYTES,
    Entry,
    RecordRejected,
    TensorBlob,
    decode_record,
    encode_record,
)
from pdpool.engine.kv.offload.store import TMP_PREFIX, FileStore

LAYOUT = {"model": "abc", "dtype": "float32", "block_size": 16, "kv_groups": ["full"]}
H = bytes(range(32))


def test_fingerprint_commits_to_layout_and_weights():
    fp = kv_fingerprint(LAYOUT, "w1")
    assert fp == kv_fingerprint(dict(LAYOUT), "w1")
    assert fp != kv_fingerprint(LAYOUT, "w2")
    for field, other in (("dtype", "bfloat16"), ("block_size", 32), ("model", "abd")):
        assert fp != kv_fingerprint({**LAYOUT, field: other}, "w1")


def test_block_key_separates_everything_it_names():
    fp = kv_fingerprint(LAYOUT, "w")
    k = block_key(fp, KIND_KV, 0, H)
    assert k == block_key(fp, KIND_KV, 0, H, None)
    others = {
        block_key(kv_fingerprint(LAYOUT, "x"), KIND_KV, 0, H),
        block_key(fp, KIND_STATE, 0, H),
        block_key(fp, KIND_KV, 1, H),
        block_key(fp, KIND_KV, 0, bytes(32)),
        block_key(fp, KIND_KV, 0, H, "adapter-a"),
    }
    assert k not in others and len(others) == 5
    with pytest.raises(ValueError):
        block_key(fp, "other", 0, H)


def _entries(keys=("k1",)) -> list[Entry]:
    return [
        Entry(
            k,
            [TensorBlob("float32", (2, 3), bytes(range(24))), TensorBlob("int8", (4,), b"abcd")],
        )
        for k in keys
    ]


def _record(key="k1", fp="fp", secret=None) -> bytes:
    return encode_record(fp, _entries((key,)), secret)


def test_record_round_trip():
    out = decode_record(_record(), "fp", "k1")
    assert [(t.dtype, t.shape, bytes(t.data)) for t in out["k1"]] == [
        ("float32", (2, 3), bytes(range(24))),
        ("int8", (4,), b"abcd"),
    ]
    many = decode_record(encode_record("fp", _entries(("a", "b", "c"))), "fp", "b")
    assert list(many) == ["a", "b", "c"]
    assert [bytes(t.data) for t in many["c"]] == [bytes(range(24)), b"abcd"]


def test_every_byte_flip_and_every_truncation_is_rejected():
    blob = _record()
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x01
        with pytest.raises(RecordRejected):
            decode_record(bytes(bad), "fp", "k1")
    for n in range(len(blob)):
        with pytest.raises(RecordRejected):
            decode_record(blob[:n], "fp", "k1")
    with pytest.raises(RecordRejected):
        decode_record(blob + b"x", "fp", "k1")


def test_foreign_key_fingerprint_or_secret_is_rejected():
    with pytest.raises(RecordRejected, match="another key"):
        decode_record(_record(), "fp", "k2")
    with pytest.raises(RecordRejected, match="another model"):
        decode_record(_record(fp="fp-other"), "fp", "k1")
    signed = _record(secret=b"s" * 32)
    assert decode_record(signed, "fp", "k1", b"s" * 32)
    with pytest.raises(RecordRejected, match="MAC"):
        decode_record(signed, "fp", "k1")  # a reader without the pool's secret
    with pytest.raises(RecordRejected, match="MAC"):
        decode_record(_record(), "fp", "k1", b"s" * 32)  # an unsigned (planted) record
    with pytest.raises(RecordRejected, match="MAC"):
        decode_record(_record(secret=b"t" * 32), "fp", "k1", b"s" * 32)  # another pool's


def test_the_record_key_is_not_the_lease_key():
    """A record's MAC is keyed with a key derived from the pool secret, so the HMAC of a
    lease payload (lease_token.py, keyed with the secret itself) never passes as one."""
    import hashlib
    import hmac

    secret = b"s" * 32
    body = _record(secret=secret)[:-DIGEST_BYTES]
    forged = body + hmac.new(secret, body, hashlib.sha256).digest()
    with pytest.raises(RecordRejected, match="MAC"):
        decode_record(forged, "fp", "k1", secret)


def test_oversized_and_overlong_records_are_refused_before_use(tmp_path):
    secret = b"s" * 32
    # A header promising more entries than any writer puts in a record.
    with pytest.raises(ValueError):
        encode_record("fp", _entries([f"k{i}" for i in range(MAX_ENTRIES + 1)]))
    # A file larger than any record is refused unread (a planted one must not be loaded).
    store = FileStore(tmp_path, 1 << 20, shared=True)
    big = store.path_of("ab12")
    big.parent.mkdir()
    with open(big, "wb") as f:
        f.truncate(MAX_RECORD_BYTES + 1)  # sparse: no disk used
    assert store.contains("ab12")
    with pytest.raises(RecordRejected, match="larger than any record"):
        store.get("ab12")
    # A header whose sizes do not add up, signed with the right secret: still refused.
    good = bytearray(_record(secret=secret))
    with pytest.raises(RecordRejected):
        decode_record(bytes(good[:-DIGEST_BYTES]) + b"\0" * DIGEST_BYTES, "fp", "k1", secret)


def test_planted_links_and_fifos_are_refused_without_blocking(tmp_path):
    """A shared directory's writer could plant a FIFO (an open would wait forever) or a
    symbolic link (to another file) under a record's name: both are refused at once."""
    store = FileStore(tmp_path / "tier", 1 << 20, shared=True)
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(b"s" * 64)
    fifo, link = store.path_of("ab01"), store.path_of("ab02")
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    link.symlink_to(secret_file)
    for key in ("ab01", "ab02"):
        assert store.contains(key)
        with pytest.raises(RecordRejected):
            store.get(key)
        store.discard(key)
        assert not store.path_of(key).exists() and not store.contains(key)
    assert secret_file.read_bytes() == b"s" * 64  # the link went, not its target


def _put(store, keys, data: bytes) -> list[str]:
    return store.put(list(keys), [data])


def test_store_is_bounded_lru(tmp_path):
    store = FileStore(tmp_path, capacity_bytes=3000)
    for k in ("aa1", "bb2", "cc3"):
        assert _put(store, [k], b"x" * 1000) == []
    assert store.get("aa1") is not None  # aa1 is now the most recent
    assert _put(store, ["dd4"], b"y" * 1000) == ["bb2"]
    assert not store.contains("bb2") and not store.path_of("bb2").exists()
    assert store.contains("aa1") and store.bytes_used == 3000
    with pytest.raises(OSError):
        _put(store, ["ee5"], b"z" * 3001)
    # A restarted engine adopts what is there, oldest out first when over its size.
    again = FileStore(tmp_path, capacity_bytes=2000)
    assert len(again) == 2 and again.bytes_used == 2000


def test_one_record_many_names_freed_with_its_last(tmp_path):
    store = FileStore(tmp_path, capacity_bytes=2500)
    assert _put(store, ["aa1", "aa2", "aa3"], b"r" * 1000) == []
    assert len(store) == 3 and store.bytes_used == 1000  # one file, three names
    assert store.path_of("aa1").stat().st_ino == store.path_of("aa3").stat().st_ino
    assert all(bytes(store.get(k) or b"") == b"r" * 1000 for k in ("aa1", "aa2", "aa3"))
    assert _put(store, ["aa2", "bb1"], b"s" * 1000) == []  # only bb1 is new
    assert store.bytes_used == 2000 and len(store) == 4
    # Room for a third record: the least recently used names go until a record is freed.
    evicted = _put(store, ["cc1"], b"t" * 1000)
    assert evicted and "cc1" not in evicted and store.bytes_used <= 2500
    again = FileStore(tmp_path, capacity_bytes=2500)  # a restart counts each record once
    assert again.bytes_used == store.bytes_used and len(again) == len(store)
    store.discard("cc1")
    assert not store.contains("cc1") and not store.path_of("cc1").exists()


def test_store_writes_atomically_and_cleans_dead_writers(tmp_path):
    store = FileStore(tmp_path, capacity_bytes=1 << 20)
    _put(store, ["ab12"], b"data")
    leftovers = [p for p in tmp_path.rglob("*") if p.name.startswith(TMP_PREFIX)]
    assert leftovers == []
    # A writer killed before its links leaves only a temporary name: never read, and
    # removed when a (private) store starts again.
    dead = tmp_path / f"{TMP_PREFIX}999.beef"
    dead.write_bytes(b"half a rec")
    old = tmp_path / "cd" / f"{TMP_PREFIX}cd34.999.beef"
    old.parent.mkdir()
    old.write_bytes(b"half a rec")
    again = FileStore(tmp_path, capacity_bytes=1 << 20)
    assert not again.contains("cd34") and not dead.exists() and not old.exists()


def test_shared_store_sees_other_writers(tmp_path):
    a = FileStore(tmp_path, 1 << 20, shared=True)
    b = FileStore(tmp_path, 1 << 20, shared=True)
    private = FileStore(tmp_path, 1 << 20, shared=False)
    _put(a, ["ef56"], b"record")
    assert b.contains("ef56") and bytes(b.get("ef56") or b"") == b"record"
    assert not private.contains("ef56")  # a private tier knows only what it scanned or wrote
    _put(b, ["ef56", "ef57"], b"other")  # ef56 exists: b links only ef57
    assert bytes(a.get("ef56") or b"") == b"record"
    os.unlink(a.path_of("ef56"))
    assert b.get("ef56") is None and not b.contains("ef56")


def test_store_refuses_bad_settings(tmp_path):
    with pytest.raises(ValueError):
        FileStore(tmp_path, 0)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OSError):
        FileStore(f, 100)


def test_memory_store_is_bounded_lru():
    from pdpool.engine.kv.offload.memory_store import MemoryStore

    store = MemoryStore(capacity_bytes=3000)
    for k in ("a", "b", "c"):
        assert _put(store, [k], b"x" * 1000) == []
    assert store.get("a") == b"x" * 1000
    assert _put(store, ["d"], b"y" * 1000) == ["b"]
    assert not store.contains("b") and store.contains("a") and store.bytes_used == 3000
    store.discard("a")
    assert store.bytes_used == 2000 and len(store) == 2 and store.get("a") is None
    assert _put(store, ["e1", "e2"], b"w" * 1000) == []  # one record, two names
    assert store.bytes_used == 3000 and len(store) == 4
    store.discard("e2")  # a bad record goes under every name
    assert not store.contains("e1") and store.bytes_used == 2000
    with pytest.raises(OSError):
        _put(store, ["f"], b"z" * 3001)
    with pytest.raises(ValueError):
        MemoryStore(0)
