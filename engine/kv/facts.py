"""What the rest of the engine may know about the KV cache without owning any of it.

The scheduler alone calls the KV cache manager. Everyone else gets facts: the shape of the
cache fixed at start (`KVCacheSpec`, `KVLayout`), how full it is (`KVCacheUsage`), and,
once per step, which blocks and state slots the scheduled requests use (`KVStepView`).
All are frozen copies, so nothing a reader does can change who holds a block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdpool.engine.kv.groups import KVGroup


@dataclass(frozen=True)
class KVLayout:
    """The cache's static shape, as a connector or the runner needs it."""

    block_size: int
    sliding: tuple[bool, ...]  # per KV group: a sliding-window group (block 0 is its null)
    has_state: bool  # recurrent-state slots exist (Qwen3.5)

    @property
    def num_groups(self) -> int:
        return len(self.sliding)


@dataclass(frozen=True)
class KVCacheSpec:
    """Everything the scheduler needs to build its KV cache manager."""

    num_blocks: int
    block_size: int
    enable_caching: bool = True
    num_state_slots: int = 0
    groups: tuple[KVGroup, ...] = (KVGroup(num_layers=1),)
    num_snapshot_slots: int = 0

    @property
    def layout(self) -> KVLayout:
        return KVLayout(
            self.block_size, tuple(g.is_sliding for g in self.groups), self.num_state_slots > 0
        )


@dataclass(frozen=True)
class KVCacheUsage:
    """How full the cache is, for gauges and metrics."""

    blocks_used: int
    blocks_total: int
    usage: float
    prefix_queries: int
    prefix_hits: int


@dataclass(frozen=True)
class KVStepView:
    """One step's blocks and state slots, handed by the scheduler to the runner: copies
    made for this step after its allocations (lists, not tuples: this is built every step
    and a list is the cheapest copy), so nothing a reader does reaches the manager."""

    # request id -> per KV group, its block ids
    block_tables: dict[str, list[list[int]]] = field(default_factory=dict)
    # request id -> its running recurrent-state slot (state models only)
    state_slots: dict[str, int] = field(default_factory=dict)
    # (snapshot slot, running slot) copies to make before the forward: prefix-hit resumes
    state_restores: tuple[tuple[int, int], ...] = ()

    def only(self, request_id: str) -> KVStepView:
        """The view of one of the step's requests, without restores (already made)."""
        slots = self.state_slots
        return KVStepView(
            {request_id: self.block_tables[request_id]},
            {request_id: slots[request_id]} if request_id in slots else {},
        )
