"""The byte format of one stored KV record, and its check: pure functions, no I/O.

    MAGIC | u32 header length | header (JSON) | payload | 32-byte MAC

One record holds many entries (the blocks of one request computed in one step, or a step's
state snapshots), each named by its key, so a write is one file and a returning request's
read is a few. The header names the fingerprint and, per entry, its key and tensors'
dtype, shape and size; the payload is the entries' tensors in order.

The MAC is HMAC-SHA256 (the signed KV lease's scheme, lease_token.py) over everything
before it, keyed with a key derived from the pool's secret, so only engines of the pool
can write a record the others accept; without a secret it is the same HMAC under an empty
key: an integrity check only (the private tiers). A reader accepts a record only when the
MAC matches, the header names the fingerprint it looked for and the key it wants, and the
payload has exactly the sizes the header promises: a torn write (an engine killed
mid-write, a full disk), a flipped byte, a file of another model or revision, a record
planted without the secret, all fail the check and read as a miss.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import struct
from dataclasses import dataclass
from typing import Optional, Sequence, Union

MAGIC = b"PDKVREC2"
DIGEST_BYTES = 32
_LEN = struct.Struct("<I")
# Bounds a reader enforces before trusting anything (a planted record must not make it
# allocate or parse without limit); writers split their records to stay inside them.
MAX_HEADER_BYTES = 4 << 20
MAX_ENTRIES = 4096
MAX_RECORD_BYTES = 1 << 30
_MAC_LABEL = b"pdpool kv offload record v2"

Buffer = Union[bytes, bytearray, memoryview]


class RecordRejected(Exception):
    """A record that must not be used; the message says why."""


@dataclass(frozen=True)
class TensorBlob:
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    data: Buffer


@dataclass(frozen=True)
class Entry:
    key: str
    tensors: list[TensorBlob]


@functools.lru_cache(maxsize=8)
def _mac_key(secret: Optional[bytes]) -> bytes:
    """The records' own key, derived from the pool secret: a record's MAC is never valid
    as a lease signature, nor the reverse."""
    if not secret:
        return b""
    return hmac.new(secret, _MAC_LABEL, hashlib.sha256).digest()


def _mac(secret: Optional[bytes], parts: Sequence[Buffer]) -> bytes:
    h = hmac.new(_mac_key(secret), digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)  # releases the GIL for large buffers
    return h.digest()


def record_parts(
    fingerprint: str, entries: Sequence[Entry], secret: Optional[bytes] = None
) -> list[Buffer]:
    """The record as buffers to write in order (the payload is not copied)."""
    if not entries or len(entries) > MAX_ENTRIES:
        raise ValueError(f"a record holds 1 to {MAX_ENTRIES} entries, not {len(entries)}")
    header = json.dumps(
        {
            "fingerprint": fingerprint,
            "entries": [
                [e.key, [[t.dtype, list(t.shape), len(t.data)] for t in e.tensors]] for e in entries
            ],
        },
        separators=(",", ":"),
    ).encode()
    parts: list[Buffer] = [MAGIC + _LEN.pack(len(header)), header]
    parts += [t.data for e in entries for t in e.tensors]
    parts.append(_mac(secret, parts))
    return parts


def encode_record(
    fingerprint: str, entries: Sequence[Entry], secret: Optional[bytes] = None
) -> bytes:
    return b"".join(record_parts(fingerprint, entries, secret))


def decode_record(
    blob: Buffer, fingerprint: str, want: str, secret: Optional[bytes] = None
) -> dict[str, list[TensorBlob]]:
    """Every entry of a record that passes every check and holds `want`, else
    RecordRejected. The tensors' data are views of `blob` (no copy)."""
    view = memoryview(blob)
    fixed = len(MAGIC) + _LEN.size
    if len(view) > MAX_RECORD_BYTES:
        raise RecordRejected(f"a {len(view)}-byte record is larger than any this engine writes")
    if len(view) < fixed + DIGEST_BYTES or view[: len(MAGIC)] != MAGIC:
        raise RecordRejected("not a KV record (bad magic or truncated)")
    body, digest = view[:-DIGEST_BYTES], view[-DIGEST_BYTES:]
    if not hmac.compare_digest(_mac(secret, [body]), digest):
        raise RecordRejected("MAC mismatch (torn, corrupt, foreign or planted record)")
    (hlen,) = _LEN.unpack_from(view, len(MAGIC))
    if hlen > MAX_HEADER_BYTES or fixed + hlen > len(body):
        raise RecordRejected("header length out of range")
    specs = _checked_header(bytes(body[fixed : fixed + hlen]), fingerprint)
    pos = fixed + hlen
    out: dict[str, list[TensorBlob]] = {}
    for key, tensors in specs:
        blobs = []
        for dtype, shape, nbytes in tensors:
            if nbytes < 0 or pos + nbytes > len(body):
                raise RecordRejected("payload shorter than its header says")
            blobs.append(TensorBlob(dtype, shape, body[pos : pos + nbytes]))
            pos += nbytes
        out[key] = blobs
    if pos != len(body):
        raise RecordRejected("payload longer than its header says")
    if want not in out:
        raise RecordRejected("record holds another key")
    return out


def _checked_header(
    raw: bytes, fingerprint: str
) -> list[tuple[str, list[tuple[str, tuple[int, ...], int]]]]:
    """The header's entries (key, [(dtype, shape, nbytes)]), once it names `fingerprint`."""
    try:
        header = json.loads(raw)
        named = header["fingerprint"]
        entries = [
            (str(key), [(str(d), tuple(int(x) for x in s), int(n)) for d, s, n in tensors])
            for key, tensors in header["entries"]
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise RecordRejected(f"malformed header: {exc}") from None
    if named != fingerprint:
        raise RecordRejected("record from another model, revision or KV layout")
    if not entries or len(entries) > MAX_ENTRIES:
        raise RecordRejected(f"a record holds 1 to {MAX_ENTRIES} entries")
    return entries
