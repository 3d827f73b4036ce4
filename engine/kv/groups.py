"""KV cache groups of a hybrid model: which attention layers share a block table.

Layers of one kind (full attention, or sliding window of one size) form a group with one
block table per request; all groups draw their blocks from one pool. A layer is given a
slot j inside its group and reads `kv_cache[:, j]`, so the cache tensor holds as many
layer slots as the largest group (vLLM's hybrid allocator uses the same trick). Recurrent
layers (Gated DeltaNet) hold no blocks: their state lives in state slots (see
`state_cache.py`) and takes part in prefix hits only through state snapshots.

    layer kinds           groups                         kv_cache layer slots
    F F F F               full(4)                        4
    S F S F (window 32)   sliding32(2), full(2)          2
    L L L F (Qwen3.5)     full(1)  + recurrent state     1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class KVGroup:
    """Full attention: every earlier token's KV is needed, so a prefix hit needs every
    block of the prefix and no block is ever released while its request runs."""

    num_layers: int

    @property
    def name(self) -> str:
        return "full"

    @property
    def is_sliding(self) -> bool:
        return False

    def first_needed_block(self, num_tokens: int, block_size: int) -> int:
        """The first block a query at position `num_tokens` still reads."""
        return 0

    def hit_len(
        self,
        is_cached: Callable[[bytes], bool],
        hashes: Sequence[bytes],
        limit: int,
        block_size: int,
    ) -> int:
        """Blocks (<= limit) of prefix this group can serve from the cache."""
        n = 0
        while n < limit and is_cached(hashes[n]):
            n += 1
        return n


@dataclass(frozen=True)
class SlidingWindowGroup(KVGroup):
    """Sliding window: a query at position p reads the keys of p-W+1 .. p only, so a hit
    needs just the last window and blocks behind it go back to the pool while running."""

    window: int = 0

    @property
    def name(self) -> str:
        return f"sliding{self.window}"

    @property
    def is_sliding(self) -> bool:
        return True

    def first_needed_block(self, num_tokens: int, block_size: int) -> int:
        return max(0, (num_tokens - self.window + 1) // block_size)

    def hit_len(
        self,
        is_cached: Callable[[bytes], bool],
        hashes: Sequence[bytes],
        limit: int,
        block_size: int,
    ) -> int:
        for n in range(limit, 0, -1):
            first = self.first_needed_block(n * block_size, block_size)
            if all(is_cached(h) for h in hashes[first:n]):
                return n
        return 0


def make_group(window: Optional[int], num_layers: int) -> KVGroup:
    return KVGroup(num_layers) if window is None else SlidingWindowGroup(num_layers, window)


def attention_groups(windows: list[Optional[int]]) -> tuple[list[KVGroup], list[tuple[int, int]]]:
    """From each attention layer's window (None: full attention), the groups and each
    layer's (group index, slot in group). Full attention comes first, then windows by size."""
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    if not kinds:
        return [], []
    counts = {w: 0 for w in kinds}
    placement = []
    for w in windows:
        placement.append((kinds.index(w), counts[w]))
        counts[w] += 1
    return [make_group(w, counts[w]) for w in kinds], placement
