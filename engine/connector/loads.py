"""A consumer's loads, from plan to result: the producer opens the lease (on a small pool
of its own, so a slow producer holds up no one else), the blocks its hashes prove are READ
over NIXL, and each load ends in a `LoadResult` that says how many tokens arrived. Runs on
the engine thread; only the opens' network I/O runs elsewhere."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from pdpool.engine.config import EngineConfig
from pdpool.engine.connector.allowlist import Allowlist, resolve_allowed
from pdpool.engine.connector.base import LoadResult
from pdpool.engine.connector.handshake import lease_call
from pdpool.engine.connector.load_plan import LoadPlan, plan_read
from pdpool.engine.connector.nixl_transport import NixlTransport, TransferState
from pdpool.engine.connector.peer_leases import PeerLeases
from pdpool.engine.connector.peering import PeerAgents
from pdpool.engine.kv.facts import KVLayout
from pdpool.engine.request import Request

log = logging.getLogger("pdpool.connector")

HANDSHAKE_TIMEOUT_S = 5.0  # a lease open, the handshake document with it when needed


class Loads:
    def __init__(
        self,
        config: EngineConfig,
        shape: KVLayout,
        transport: NixlTransport,
        layout: dict,
        allowlist: Allowlist,
        peer_leases: PeerLeases,
        counters: dict[str, int],
    ) -> None:
        self.config = config
        self.block_size = shape.block_size
        self.sliding = list(shape.sliding)
        self.transport = transport
        self.allowlist = allowlist
        self.peer_leases = peer_leases
        self.counters = counters  # the connector's
        self.peers = PeerAgents(transport, layout, counters)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-lease")
        self._waiting: dict[str, LoadPlan] = {}  # planned, READ not started
        self._reading: dict[str, LoadPlan] = {}  # READ in flight
        self._failed: list[LoadResult] = []
        self._aborted_reads_ended: list[str] = []

    def __len__(self) -> int:
        return len(self._reading) + len(self._waiting)

    def plan(self, plan: LoadPlan) -> None:
        self._waiting[plan.request_id] = plan

    def start(self) -> None:
        for plan in list(self._waiting.values()):
            if plan.opening is None:
                self._open(plan)

    def poll(self) -> list[LoadResult]:
        """The loads that ended since the last poll."""
        self._finish_opens()
        results, self._failed = self._failed, []
        for rid, plan in list(self._reading.items()):
            tid = plan.read_id
            state = self.transport.poll(tid)
            if state is TransferState.IN_PROGRESS:
                continue
            arrived = state is TransferState.DONE
            error = None if arrived else self.transport.transfer(tid).error
            self.transport.release(tid)
            del self._reading[rid]
            if not arrived:
                # The notification that frees the producer's lease will not come.
                self.peer_leases.release(plan.host, plan.port, plan.token)
                reading_from = {
                    self.transport.transfer(p.read_id).peer for p in self._reading.values()
                }
                self.peers.forget((plan.host, plan.port), reading_from)
            if plan.aborted:
                self._aborted_reads_ended.append(rid)
                continue
            results.append(self._result(plan, error, arrived))
        return results

    def take_aborted_reads_ended(self) -> list[str]:
        """Aborted requests whose READ has ended since the last call."""
        ended, self._aborted_reads_ended = self._aborted_reads_ended, []
        return ended

    def abort(self, request: Request) -> bool:
        """Forgets an aborted request's load; True when its READ is still in flight."""
        waiting = self._waiting.pop(request.request_id, None)
        if waiting is not None:
            self._abandon(waiting)
        plan = self._reading.get(request.request_id)
        if plan is None:
            return False
        # The READ may still write into the request's blocks: they stay until it ends.
        plan.aborted = True
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _open(self, plan: LoadPlan) -> None:
        key = (plan.host, plan.port)
        try:
            address = resolve_allowed(plan.host, self.allowlist)
        except PermissionError as exc:
            self.counters["peers_refused"] += 1
            log.warning("refusing KV peer %s:%d: %s", plan.host, plan.port, exc)
            del self._waiting[plan.request_id]
            self._failed.append(self._result(plan, str(exc)))
            return
        message = {
            "op": "open",
            "lease_id": plan.token.lease_id,
            "epoch": plan.token.epoch,
            "read_timeout_s": self.config.kv_load_timeout,
            "known_agent": self.peers.known(key),
        }
        plan.opening = self._pool.submit(
            lease_call, address, plan.port, message, HANDSHAKE_TIMEOUT_S
        )

    def _finish_opens(self) -> None:
        for rid, plan in list(self._waiting.items()):
            if plan.opening is None or not plan.opening.done():
                continue
            del self._waiting[rid]
            try:
                reply = plan.opening.result()
                agent = self.peers.from_reply((plan.host, plan.port), reply)
            except Exception as exc:  # I/O, a refused lease, an incompatible peer, NIXL
                self._failed.append(self._result(plan, str(exc)))
                continue
            self._start_read(agent, plan, reply["lease"])

    def _start_read(self, agent: str, plan: LoadPlan, lease: dict) -> None:
        remote_units = self.transport.peer_regions(agent)["kv"].num_units
        try:
            units, cut_by_content = plan_read(
                plan, lease, remote_units, self.sliding, self.block_size
            )
        except (KeyError, TypeError, ValueError) as exc:
            self._failed.append(self._result(plan, f"malformed lease from the peer: {exc!r}"))
            self.peer_leases.release(plan.host, plan.port, plan.token)
            return
        if cut_by_content:
            self.counters["content_mismatches"] += 1
        try:
            # The notification names the lease: the producer ends it on arrival.
            plan.transfer_id = self.transport.start_read(
                agent,
                units,
                notification=plan.token.lease_id,
                timeout_s=self.config.kv_load_timeout,
            )
        except Exception as exc:
            self.peer_leases.release(plan.host, plan.port, plan.token)
            self._failed.append(self._result(plan, f"READ refused: {exc}"))
            return
        self._reading[plan.request_id] = plan

    def _abandon(self, plan: LoadPlan) -> None:
        if plan.opening is not None:
            plan.opening.cancel()
        self.peer_leases.release(plan.host, plan.port, plan.token)

    def _result(self, plan: LoadPlan, error: Optional[str], arrived: bool = False) -> LoadResult:
        """`arrived`: the READ completed, so the verified prefix of the blocks is here."""
        loaded = (
            min(plan.num_external, plan.num_valid_positions * self.block_size) if arrived else 0
        )
        wanted = plan.num_positions
        if arrived and plan.num_valid_positions < wanted:
            error = (
                f"only {plan.num_valid_positions} of {wanted} leased blocks hold this "
                "prompt's tokens"
            )
        restart = False
        snapshot = plan.boundary_snapshot
        snapshot_arrived = (
            arrived and error is None and snapshot is not None and snapshot[1] is not None
        )
        if plan.wants_state and (error is not None or not loaded):
            # Blocks without the state at their end are useless to a recurrent model.
            loaded, restart = 0, True
        if error is None:
            self.counters["loads_ok"] += 1
        else:
            self.counters["loads_failed"] += 1
            log.warning(
                "KV load for %s: %s; computing locally from prompt token %d",
                plan.request_id,
                error,
                loaded,
            )
        self.counters["tokens_pulled"] += loaded
        return LoadResult(plan.request_id, loaded, error, restart, snapshot_arrived)
