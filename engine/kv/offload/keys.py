"""What names a KV block outside one engine's pool: pure functions, no I/O.

A block's KV depends on more than its tokens: the model (architecture, weights, revision),
the dtype, the block size and the cache layout. The fingerprint commits to all of them, so
two engines agree on it exactly when a block computed by one is valid in the other. The
offload tiers key every file by (fingerprint, what is stored, KV group, chained block hash,
adapter), and the signed KV lease carries the same fingerprint, so neither a file nor a
pulled block from another model or another revision is ever used: it is a miss, and the
tokens are recomputed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Optional

FINGERPRINT_VERSION = 1

# What a stored record holds: one attention group's KV of a block, or the recurrent state
# (Gated DeltaNet conv and SSM) after a block boundary.
KIND_KV = "kv"
KIND_STATE = "state"


def kv_fingerprint(layout: Mapping[str, Any], weights_digest: str) -> str:
    """A hex digest of everything that must match for KV to be reused: the engine's KV
    layout facts (model config hash, dtype, block size, tensor layout, groups; see
    engine_setup.KVMemory.layout) and a digest of the checkpoint's weights and config."""
    doc = {"v": FINGERPRINT_VERSION, "layout": dict(layout), "weights": weights_digest}
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def block_key(
    fingerprint: str,
    kind: str,
    group: int,
    block_hash: bytes,
    adapter_id: Optional[str] = None,
) -> str:
    """The content address of one record. `block_hash` already chains the cache_salt;
    `adapter_id` is the LoRA adapter the KV was computed under (None: the base model)."""
    if kind not in (KIND_KV, KIND_STATE):
        raise ValueError(f"unknown record kind {kind!r}")
    h = hashlib.sha256()
    h.update(b"pdpool-kv-record\0")
    h.update(fingerprint.encode())
    h.update(b"\0" + kind.encode() + b"\0")
    h.update(group.to_bytes(4, "big"))
    h.update(block_hash)
    h.update(b"\0" + (adapter_id or "").encode())
    return h.hexdigest()
