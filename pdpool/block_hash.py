"""The chained block hash every pdpool engine names its KV blocks by (no torch).

One definition, shared by the engine (`engine/kv/hashing.py`) and the gateway's KV index,
which must compute the same names for a prompt as the engines publish in their events.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Optional, Sequence


def hash_block(
    parent: Optional[bytes], token_ids: Sequence[int], extra_keys: tuple[object, ...] = ()
) -> bytes:
    h = hashlib.sha256()
    h.update(parent if parent is not None else b"pdpool-root")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(json.dumps(list(extra_keys), sort_keys=True).encode())
    return h.digest()


def chain_hashes(
    token_ids: Sequence[int], block_size: int, extra_keys: tuple[object, ...] = ()
) -> list[bytes]:
    """The hashes of every full block of `token_ids`; extra keys go into the first only."""
    out: list[bytes] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(
            parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys if i == 0 else ()
        )
        out.append(parent)
    return out
