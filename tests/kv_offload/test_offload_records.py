"""The offload tier's pure parts and its file store: keys, fingerprints, the record format
and its checks, atomic writes and the byte bound."""

from __future__ import annotations

import os

import pytest

from pdpool.engine.kv.offload.keys import KIND_KV, KIND_STATE, block_key, kv_fingerprint
from pdpool.engine.kv.offload.record import (
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


def _record(key="k1", fp="fp", secret=None) -> bytes:
    return encode_record(
        key,
        fp,
        [TensorBlob("float32", (2, 3), bytes(range(24))), TensorBlob("int8", (4,), b"abcd")],
        secret,
    )


def test_record_round_trip():
    out = decode_record(_record(), "k1", "fp")
    assert [(t.dtype, t.shape, t.data) for t in out] == [
        ("float32", (2, 3), bytes(range(24))),
        ("int8", (4,), b"abcd"),
    ]


def test_every_byte_flip_and_every_truncation_is_rejected():
    blob = _record()
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x01
        with pytest.raises(RecordRejected):
            decode_record(bytes(bad), "k1", "fp")
    for n in range(len(blob)):
        with pytest.raises(RecordRejected):
            decode_record(blob[:n], "k1", "fp")
    with pytest.raises(RecordRejected):
        decode_record(blob + b"x", "k1", "fp")


def test_foreign_key_fingerprint_or_secret_is_rejected():
    with pytest.raises(RecordRejected, match="another key"):
        decode_record(_record(), "k2", "fp")
    with pytest.raises(RecordRejected, match="another model"):
        decode_record(_record(fp="fp-other"), "k1", "fp")
    signed = _record(secret=b"s" * 32)
    assert decode_record(signed, "k1", "fp", b"s" * 32)
    with pytest.raises(RecordRejected):
        decode_record(signed, "k1", "fp")  # a reader without the pool's secret
    with pytest.raises(RecordRejected):
        decode_record(_record(), "k1", "fp", b"s" * 32)  # an unsigned record


def test_store_is_bounded_lru(tmp_path):
    store = FileStore(tmp_path, capacity_bytes=3000)
    for k in ("aa1", "bb2", "cc3"):
        assert store.put(k, b"x" * 1000) == []
    assert store.get("aa1") is not None  # aa1 is now the most recent
    assert store.put("dd4", b"y" * 1000) == ["bb2"]
    assert not store.contains("bb2") and not store.path_of("bb2").exists()
    assert store.contains("aa1") and store.bytes_used == 3000
    with pytest.raises(OSError):
        store.put("ee5", b"z" * 3001)
    # A restarted engine adopts what is there, oldest out first when over its size.
    again = FileStore(tmp_path, capacity_bytes=2000)
    assert len(again) == 2 and again.bytes_used == 2000


def test_store_writes_atomically_and_cleans_dead_writers(tmp_path):
    store = FileStore(tmp_path, capacity_bytes=1 << 20)
    store.put("ab12", b"data")
    leftovers = [p for p in tmp_path.rglob("*") if p.name.startswith(TMP_PREFIX)]
    assert leftovers == []
    # A writer killed before its rename leaves only a temporary name: never read, and
    # removed when a (private) store starts again.
    dead = tmp_path / "cd" / f"{TMP_PREFIX}cd34.999.beef"
    dead.parent.mkdir()
    dead.write_bytes(b"half a rec")
    again = FileStore(tmp_path, capacity_bytes=1 << 20)
    assert not again.contains("cd34") and not dead.exists()


def test_shared_store_sees_other_writers(tmp_path):
    a = FileStore(tmp_path, 1 << 20, shared=True)
    b = FileStore(tmp_path, 1 << 20, shared=True)
    private = FileStore(tmp_path, 1 << 20, shared=False)
    a.put("ef56", b"record")
    assert b.contains("ef56") and b.get("ef56") == b"record"
    assert not private.contains("ef56")  # a private tier knows only what it scanned or wrote
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
        assert store.put(k, b"x" * 1000) == []
    assert store.get("a") == b"x" * 1000
    assert store.put("d", b"y" * 1000) == ["b"]
    assert not store.contains("b") and store.contains("a") and store.bytes_used == 3000
    store.discard("a")
    assert store.bytes_used == 2000 and len(store) == 2 and store.get("a") is None
    with pytest.raises(OSError):
        store.put("e", b"z" * 3001)
    with pytest.raises(ValueError):
        MemoryStore(0)
