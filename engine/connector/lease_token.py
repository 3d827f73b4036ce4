"""The lease a producer attaches to the kv_transfer_params it issues, and its signature.

The lease rides inside kv_transfer_params under one key, so routers that forward the
object verbatim (llm-d's sidecar, ours) carry it without knowing it:

  "pdpool_lease": {"id": str, "epoch": str, "num_tokens": int, "hash": hex,
                   "expires_ms": int, "fp": hex, "sig": hex (only when the pool has a secret)}

`hash` is the chained hash of the leased tokens (it commits to every one of them), so a
consumer can refuse, before any connection, params that describe another prompt. `fp` is
the producer's KV fingerprint (kv/offload/keys.py: model, weights, dtype, block size,
layout): a consumer refuses KV made by another model or revision (a rolling update's two
versions never mix) and recomputes. `sig` is
HMAC-SHA256 with the pool's secret over the lease and every field a consumer acts on
(engine id, host, port, block ids, token counts, direction): a caller without the secret
can neither forge params nor point real ones elsewhere. Integers and strings only, so a
router that re-encodes JSON (Go's float64 numbers included) keeps the signature valid.
Pure functions, no I/O except reading the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

LEASE_KEY = "pdpool_lease"
SECRET_ENV = "PDPOOL_KV_SECRET"
SECRET_FILE_ENV = "PDPOOL_KV_SECRET_FILE"
# Clocks of two pods may differ a little; an expiry is checked with this much slack.
CLOCK_SKEW_MS = 2000
_SIGNED_PARAMS = (
    "do_remote_prefill",
    "do_remote_decode",
    "remote_engine_id",
    "remote_request_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
    "remote_num_tokens",
)


class LeaseTokenError(ValueError):
    """kv_transfer_params whose lease is missing, malformed, expired or badly signed."""


@dataclass(frozen=True)
class LeaseToken:
    lease_id: str
    epoch: str
    num_tokens: int
    prefix_hash: bytes
    expires_ms: int
    # The producer's KV fingerprint; "" from a producer that sent none (refused).
    fingerprint: str = ""


def load_secret(path: Optional[str] = None) -> Optional[bytes]:
    """The pool secret: from `path`, else $PDPOOL_KV_SECRET_FILE, else $PDPOOL_KV_SECRET.
    Surrounding whitespace is ignored; an empty secret is an error, not "no secret"."""
    path = path or os.environ.get(SECRET_FILE_ENV) or None
    if path:
        try:
            with open(path, "rb") as fh:
                raw = fh.read().strip()
        except OSError as exc:
            raise ValueError(f"--kv-secret-file {path}: {exc.strerror}") from None
        source = path
    elif os.environ.get(SECRET_ENV) is not None:
        raw, source = os.environ[SECRET_ENV].strip().encode(), f"${SECRET_ENV}"
    else:
        return None
    if len(raw) < 16:
        raise ValueError(
            f"the KV secret in {source} is too short ({len(raw)} bytes; at least 16 are needed)"
        )
    return raw


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _signed_payload(params: Mapping[str, Any], lease: Mapping[str, Any]) -> bytes:
    fields = {k: params.get(k) for k in _SIGNED_PARAMS}
    for flag in ("do_remote_prefill", "do_remote_decode"):  # absent means false
        fields[flag] = bool(fields[flag])
    return _canonical({"params": fields, "lease": {k: v for k, v in lease.items() if k != "sig"}})


def attach(params: dict[str, Any], token: LeaseToken, secret: Optional[bytes]) -> dict[str, Any]:
    """Adds the lease (signed when there is a secret) to params issued by a producer."""
    lease = {
        "id": token.lease_id,
        "epoch": token.epoch,
        "num_tokens": token.num_tokens,
        "hash": token.prefix_hash.hex(),
        "expires_ms": token.expires_ms,
    }
    if token.fingerprint:
        lease["fp"] = token.fingerprint
    if secret is not None:
        lease["sig"] = hmac.new(secret, _signed_payload(params, lease), hashlib.sha256).hexdigest()
    params[LEASE_KEY] = lease
    return params


def _str(lease: Mapping[str, Any], key: str, max_len: int = 128) -> str:
    v = lease.get(key)
    if not isinstance(v, str) or not v or len(v) > max_len:
        raise LeaseTokenError(f"{LEASE_KEY}.{key} must be a non-empty string")
    return v


def _int(lease: Mapping[str, Any], key: str) -> int:
    v = lease.get(key)
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # a router that decoded JSON numbers as floats
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise LeaseTokenError(f"{LEASE_KEY}.{key} must be a non-negative integer")
    return v


def read(
    params: Mapping[str, Any], secret: Optional[bytes], now_ms: Optional[int] = None
) -> LeaseToken:
    """The lease of kv_transfer_params, checked: well-formed, signed when we have a secret,
    not expired. Raises LeaseTokenError saying why not."""
    lease = params.get(LEASE_KEY)
    if not isinstance(lease, Mapping):
        raise LeaseTokenError(
            f"kv_transfer_params carry no {LEASE_KEY}: only KV held under "
            "a lease by a pdpool engine can be loaded"
        )
    lease_id, epoch = _str(lease, "id"), _str(lease, "epoch")
    num_tokens, expires_ms = _int(lease, "num_tokens"), _int(lease, "expires_ms")
    try:
        prefix = bytes.fromhex(_str(lease, "hash"))
    except ValueError:
        raise LeaseTokenError(f"{LEASE_KEY}.hash must be hex") from None
    if num_tokens < 1:
        raise LeaseTokenError(f"{LEASE_KEY}.num_tokens must be at least 1")
    fingerprint = _str(lease, "fp") if lease.get("fp") is not None else ""
    if secret is not None:
        sig = lease.get("sig")
        if not isinstance(sig, str):
            raise LeaseTokenError(
                "unsigned kv_transfer_params (this engine requires the pool's signature)"
            )
        normalized = {
            **{k: v for k, v in lease.items() if k != "sig"},
            "num_tokens": num_tokens,
            "expires_ms": expires_ms,
        }
        want = hmac.new(secret, _signed_payload(params, normalized), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(sig, want):
            raise LeaseTokenError(
                "kv_transfer_params with a bad signature (forged, tampered "
                "or signed with another pool's secret)"
            )
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    if expires_ms + CLOCK_SKEW_MS < now_ms:
        raise LeaseTokenError(f"the KV lease {lease_id} expired {now_ms - expires_ms} ms ago")
    return LeaseToken(lease_id, epoch, num_tokens, prefix, expires_ms, fingerprint)
