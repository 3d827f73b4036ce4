"""The byte format of one stored KV record, and its check: pure functions, no I/O.

    MAGIC | u32 header length | header (JSON) | payload | 32-byte digest

The digest is BLAKE2b over everything before it (keyed with the pool's secret when there
is one, so that only engines of the pool can write a record others accept). A reader
accepts a record only when the digest matches, the header names the key and fingerprint it
looked for, and the payload has exactly the sizes the header promises: a torn write (an
engine killed mid-write, a full disk), a flipped byte, a file of another model or another
revision, all fail the check and read as a miss.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass
from typing import Optional

MAGIC = b"PDKVREC1"
DIGEST_BYTES = 32
_LEN = struct.Struct("<I")
# Headers are small (a few tensors' shapes): a larger one is not ours.
MAX_HEADER_BYTES = 1 << 16


class RecordRejected(Exception):
    """A record that must not be used; the message says why."""


@dataclass(frozen=True)
class TensorBlob:
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    data: bytes


def _digest(secret: Optional[bytes], parts: list[bytes]) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, key=(secret or b"")[:64])
    for p in parts:
        h.update(p)
    return h.digest()


def encode_record(
    key: str, fingerprint: str, tensors: list[TensorBlob], secret: Optional[bytes] = None
) -> bytes:
    header = json.dumps(
        {
            "key": key,
            "fingerprint": fingerprint,
            "tensors": [
                {"dtype": t.dtype, "shape": list(t.shape), "nbytes": len(t.data)} for t in tensors
            ],
        },
        separators=(",", ":"),
    ).encode()
    parts = [MAGIC, _LEN.pack(len(header)), header, *(t.data for t in tensors)]
    return b"".join([*parts, _digest(secret, parts)])


def decode_record(
    blob: bytes, key: str, fingerprint: str, secret: Optional[bytes] = None
) -> list[TensorBlob]:
    """The tensors of a record that passes every check, else RecordRejected."""
    fixed = len(MAGIC) + _LEN.size
    if len(blob) < fixed + DIGEST_BYTES or not blob.startswith(MAGIC):
        raise RecordRejected("not a KV record (bad magic or truncated)")
    body, digest = blob[:-DIGEST_BYTES], blob[-DIGEST_BYTES:]
    if not hmac.compare_digest(_digest(secret, [body]), digest):
        raise RecordRejected("content digest mismatch (torn, corrupt or foreign record)")
    (hlen,) = _LEN.unpack_from(blob, len(MAGIC))
    if hlen > MAX_HEADER_BYTES or fixed + hlen > len(body):
        raise RecordRejected("header length out of range")
    specs = _checked_header(body[fixed : fixed + hlen], key, fingerprint)
    pos = fixed + hlen
    out = []
    for dtype, shape, nbytes in specs:
        if nbytes < 0 or pos + nbytes > len(body):
            raise RecordRejected("payload shorter than its header says")
        out.append(TensorBlob(dtype, shape, body[pos : pos + nbytes]))
        pos += nbytes
    if pos != len(body):
        raise RecordRejected("payload longer than its header says")
    return out


def _checked_header(
    raw: bytes, key: str, fingerprint: str
) -> list[tuple[str, tuple[int, ...], int]]:
    """The header's tensor specs (dtype, shape, nbytes), once it names `key` and
    `fingerprint`."""
    try:
        header = json.loads(raw)
        named = (header["key"], header["fingerprint"])
        specs = [
            (str(t["dtype"]), tuple(int(d) for d in t["shape"]), int(t["nbytes"]))
            for t in header["tensors"]
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise RecordRejected(f"malformed header: {exc}") from None
    if named[0] != key:
        raise RecordRejected("record holds another key")
    if named[1] != fingerprint:
        raise RecordRejected("record from another model, revision or KV layout")
    return specs
