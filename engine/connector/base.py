"""The KV connector interface the scheduler talks to.

Split as vLLM splits it, though both halves run on the engine thread here:
- scheduler side: how many of a request's tokens will come from another engine
  (`get_num_new_matched_tokens`), what to do once blocks are allocated for them
  (`update_state_after_alloc`), what to answer when a request finishes and whether its
  blocks must outlive it (`request_finished`), and what to tell a router when a request is
  rejected (`describe_rejected`);
- worker side: register the KV memory (at construction), start the loads, and report what
  ended: loads (with how many tokens actually arrived), aborted reads, leases (`poll`).
The connector never touches the KV cache manager: the scheduler tells it block ids and
state slots (`AllocatedKV`, `FinishedKV`, `CachedPrefix`), the connector answers with the
blocks it wants kept (`BlockHold`, held by the scheduler under a lease id), and says when
they may go (`TransferReport`). One owner decides when a block is freed.
`KVConnector` itself is the `none` connector: nothing comes from, or goes to, anyone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pdpool.engine.request import Request, RequestStatus


@dataclass
class LoadResult:
    request_id: str
    # Tokens (after the local hit) whose KV arrived, counted from the first pulled token;
    # a failure partway keeps only the blocks before the first missing one.
    num_loaded_tokens: int
    error: Optional[str] = None
    # A recurrent state that did not arrive cannot resume mid-prompt: start from zero.
    restart: bool = False
    # The peer's state snapshot at the last block boundary arrived in the slot the
    # scheduler reserved for it (`AllocatedKV.boundary_snapshot`): it may be published.
    boundary_snapshot_arrived: bool = False


@dataclass(frozen=True)
class AllocatedKV:
    """Where a request's pulled KV goes: its blocks, and for recurrent-state models its
    running state slot and a snapshot slot reserved for the state at the last block
    boundary of the pulled tokens (slot, that block's hash), when none is cached yet."""

    block_tables: list[list[int]]
    state_slot: Optional[int] = None
    boundary_snapshot: Optional[tuple[int, bytes]] = None


@dataclass(frozen=True)
class FinishedKV:
    """A finished request's KV as a connector may lease it: its block ids per group, and
    for a prefill leg of a recurrent-state model the state pinned for the decode engine
    and the snapshot at the last block boundary before it (None when absent)."""

    block_tables: list[list[int]]
    transfer_state_slot: Optional[int] = None
    boundary_snapshot_slot: Optional[int] = None


@dataclass(frozen=True)
class CachedPrefix:
    """The cached prefix of a rejected request: the hit's block ids per group, its length,
    and the state snapshot at its end (recurrent-state models; None when absent)."""

    block_tables: list[list[int]]
    num_tokens: int
    snapshot_slot: Optional[int] = None


@dataclass(frozen=True)
class BlockHold:
    """Keep these until I say: the blocks of the first `num_tokens` tokens (of the finished
    request, or of the rejected request's hit) and `state_slots`, held under `lease_id`
    until a `TransferReport` names the lease as ended."""

    lease_id: str
    num_tokens: int
    state_slots: tuple[int, ...] = ()


@dataclass
class Handoff:
    """A connector's answer at a request's end: the response's kv_transfer_params, and
    the blocks to keep for a peer, if any."""

    params: Optional[dict[str, Any]] = None
    hold: Optional[BlockHold] = None


@dataclass
class TransferReport:
    """What ended since the last poll."""

    loads: list[LoadResult] = field(default_factory=list)
    # Aborted requests whose READ has ended: the blocks it wrote into may go.
    reads_ended: list[str] = field(default_factory=list)
    # Leases granted by this engine that were released or expired: their holds may go.
    leases_ended: list[str] = field(default_factory=list)


class KVConnector:
    name = "none"

    # --- scheduler side -----------------------------------------------------------------
    def check_request(self, request: Request) -> Optional[str]:
        """On arrival: why the request's kv_transfer_params cannot be trusted (then nothing
        is loaded for it), or None."""
        return None

    def release_lease(self, params: object) -> bool:
        """Ends a lease this engine granted, named by the params it issued."""
        return False

    def will_load_state(self, request: Request) -> bool:
        """The request's recurrent state will come from a peer, so the local lookup need
        not find a state snapshot (per-group hits, as vLLM PR #42524 proposes for hybrid
        KV consumers)."""
        return False

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> int:
        return 0

    def update_state_after_alloc(
        self,
        request: Request,
        allocated: AllocatedKV,
        num_local_computed: int,
        num_external: int,
    ) -> None:
        raise RuntimeError("the none connector never loads KV")

    def request_finished(
        self, request: Request, status: RequestStatus, finished: FinishedKV
    ) -> Handoff:
        """Called before a finished request's blocks are freed: the response's
        kv_transfer_params, and the blocks to hold for a peer."""
        return Handoff()

    def describe_rejected(self, request: Request, prefix: CachedPrefix) -> Handoff:
        """kv_transfer_params for a request rejected below its cache-hit threshold, and
        the cached prefix to hold for a peer."""
        return Handoff()

    def request_aborted(self, request: Request) -> bool:
        """A request that may be loading was aborted. True when a READ may still write
        into its blocks: they must stay allocated until `poll` reports the read ended."""
        return False

    # --- worker side --------------------------------------------------------------------
    def start_loads(self) -> None:
        pass

    def poll(self) -> TransferReport:
        return TransferReport()

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
