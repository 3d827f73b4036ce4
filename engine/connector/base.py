"""The KV connector interface the engine core and scheduler talk to.

Split as vLLM splits it, though both halves run on the engine thread here:
- scheduler side: how many of a request's tokens will come from another engine
  (`get_num_new_matched_tokens`), what to do once blocks are allocated for them
  (`update_state_after_alloc`), what to answer when a request finishes and whether to hold
  its blocks (`request_finished`), and what to tell a router when a request is rejected
  (`describe_rejected`);
- worker side: register the KV memory (at construction), start the loads, and report the
  loads that finished, with how many tokens actually arrived (`poll`).
`KVConnector` itself is the `none` connector: nothing comes from, or goes to, anyone.
"""

from __future__ import annotations

from dataclasses import dataclass
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
        block_tables: list[list[int]],
        num_local_computed: int,
        num_external: int,
    ) -> None:
        raise RuntimeError("the none connector never loads KV")

    def request_finished(self, request: Request, status: RequestStatus) -> Optional[dict[str, Any]]:
        """Called before a finished request's blocks are freed; may detach them to hold
        them for a peer. Returns the response's kv_transfer_params."""
        return None

    def describe_rejected(
        self, request: Request, hits: list[Any], num_cached: int
    ) -> Optional[dict[str, Any]]:
        """kv_transfer_params for a request rejected below its cache-hit threshold."""
        return None

    def request_aborted(self, request: Request) -> None:
        """A request that may be loading was aborted: blocks under a READ stay held."""

    # --- worker side --------------------------------------------------------------------
    def start_loads(self) -> None:
        pass

    def poll(self) -> list[LoadResult]:
        return []

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
