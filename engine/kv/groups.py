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
from typing import Optional


@dataclass(frozen=True)
class KVGroup:
    kind: str                 # "full" or "sliding"
    window: Optional[int]     # sliding window size in tokens
    num_layers: int

    @property
    def name(self) -> str:
        return "full" if self.kind == "full" else f"sliding{self.window}"


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
    groups = [KVGroup("full" if w is None else "sliding", w, counts[w]) for w in kinds]
    return groups, placement
