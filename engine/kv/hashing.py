"""Chained block hashes: a block is named by its parent's hash, its tokens and extra keys.

sha256 over a fixed byte encoding, so that two engine processes (a prefill and a decode
engine, or one engine before and after a restart) compute the same hash for the same
prefix. Extra keys (e.g. a tenant's cache_salt) go into the first block only; since every
later hash chains through it, the whole prefix is isolated per salt.
"""

from __future__ import annotations

from typing import Optional, Sequence

# The definition lives in pdpool/block_hash.py so that the gateway's KV index (no engine
# imports) computes exactly the names engines publish.
from pdpool.block_hash import hash_block

__all__ = ["BlockHasher", "hash_block", "prefix_hash"]


class BlockHasher:
    def __init__(self, block_size: int, extra_keys: tuple[object, ...] = ()):
        self.block_size = block_size
        self.extra_keys = extra_keys

    def hash_blocks(
        self, token_ids: Sequence[int], existing: Sequence[bytes], num_full_blocks: int
    ) -> list[bytes]:
        """Hashes of blocks len(existing)..num_full_blocks-1, chained on `existing`."""
        out: list[bytes] = []
        parent = existing[-1] if existing else None
        bs = self.block_size
        for i in range(len(existing), num_full_blocks):
            extra = self.extra_keys if i == 0 else ()
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs], extra)
            out.append(parent)
        return out


def prefix_hash(
    token_ids: Sequence[int],
    block_hashes: Sequence[bytes],
    num_tokens: int,
    block_size: int,
    extra_keys: tuple[object, ...] = (),
) -> Optional[bytes]:
    """The chained hash of the first `num_tokens` tokens: the full block hash when they end
    on a block boundary, else the hash of the partial last block chained on the full ones.
    It commits to every one of those tokens, so two engines agree on it exactly when they
    hold the same prefix (same salt, same block size). None for an empty prefix or when
    `block_hashes` does not reach that far."""
    k, rest = divmod(num_tokens, block_size)
    if num_tokens <= 0 or len(block_hashes) < k or len(token_ids) < num_tokens:
        return None
    if rest == 0:
        return block_hashes[k - 1]
    return hash_block(
        block_hashes[k - 1] if k else None,
        token_ids[k * block_size : num_tokens],
        extra_keys if k == 0 else (),
    )
