"""The NIXL KV connector: P/D transfer in both directions, fail-closed.

Directions (the `kv_transfer_params` contract, wire-compatible with vLLM's NixlConnector):
- a prefill leg (`do_remote_decode`) finishes with its blocks held under a lease for the
  decode engine and answers where they are (`do_remote_prefill: true`, engine id, host,
  port, block ids, and the lease);
- a decode leg (`do_remote_prefill`) READs the blocks it does not already cache and
  computes only what is left (the last prompt token);
- bidirectional: a decode engine that rejects a request (cache-hit threshold) describes the
  prefix it caches (`do_remote_decode: true`, `remote_block_ids`, `remote_num_tokens`) under
  a short lease; a prefill engine given such a description READs that prefix instead of
  recomputing it when it gains at least `--kv-pull-threshold` tokens.

Trust (docs/nixl.md has the threat model): the params carry a lease (`lease_token.py`),
signed with the pool's secret when there is one, and bound to the chained hash of the
leased tokens. A consumer refuses params it cannot verify before touching anything; it
then *opens* the lease with the producer over the handshake port, which succeeds once,
only while the lease is live and only in the producer's current epoch, pins it for the
read and answers which blocks hold what (block hashes). Only blocks whose hashes equal the
consumer's own for its prompt are read; they alone count as computed and enter the prefix
cache. The READ's NIXL notification names the lease and ends it; a failed or abandoned
read releases it explicitly; otherwise it expires after `--kv-producer-timeout`, which a
consumer that still wants it (its request waits in the queue) keeps renewing. The open's
answer names the producer's NIXL agent: a new one (the producer restarted) replaces the
old agent, so transfers heal with the next request.

This module is the connector the scheduler and engine core call: the trust check on
arrival, how many tokens a request gets from a peer, and the lease a finished prefill leg
or a rejected request is held under. Its parts:
    loads.py         a consumer's loads: the lease opened, the READ, the load's result
    load_plan.py     a load's plan, and which of a lease's blocks hold this prompt's tokens
    peer_leases.py   renewals and releases of the leases a consumer holds on producers
    peering.py       producers' NIXL agents, admitted and replaced when they restart
    lease_desk.py    a producer's answers to its peers' lease operations
Everything runs on the engine thread, except network I/O with peers (small pools) and the
lease desk (the handshake server's threads, which touch only the lease table).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Optional

from pdpool.engine.config import EngineConfig
from pdpool.engine.connector.allowlist import parse_allowlist
from pdpool.engine.connector.base import (
    AllocatedKV,
    BlockHold,
    CachedPrefix,
    FinishedKV,
    Handoff,
    KVConnector,
    TransferReport,
)
from pdpool.engine.connector.handshake import HandshakeServer, document_for
from pdpool.engine.connector.lease_desk import LeaseDesk
from pdpool.engine.connector.lease_token import SECRET_ENV, LeaseToken, LeaseTokenError
from pdpool.engine.connector.lease_token import attach as attach_lease
from pdpool.engine.connector.lease_token import read as read_lease
from pdpool.engine.connector.load_plan import LoadPlan, state_slots_of
from pdpool.engine.connector.loads import HANDSHAKE_TIMEOUT_S, Loads
from pdpool.engine.connector.nixl_transport import NixlTransport
from pdpool.engine.connector.peer_leases import PeerLeases
from pdpool.engine.kv.facts import KVLayout
from pdpool.engine.kv.hashing import prefix_hash
from pdpool.engine.kv.leases import Lease, LeaseTable
from pdpool.engine.request import Request, RequestStatus

log = logging.getLogger("pdpool.connector")

COUNTERS = (
    "loads_ok",
    "loads_failed",
    "tokens_pulled",
    "peers_refused",
    "peers_replaced",
    "params_refused",
    "content_mismatches",
    "fingerprint_mismatches",
    "lease_renewals_sent",
    "lease_releases_sent",
)


class NixlConnector(KVConnector):
    name = "nixl"

    def __init__(
        self,
        config: EngineConfig,
        shape: KVLayout,
        kv_cache,
        layout: dict,
        state=None,
        engine_id: Optional[str] = None,
        secret: Optional[bytes] = None,
        fingerprint: str = "",
    ):
        self.config = config
        # What produced this engine's KV (kv/offload/keys.py); signed into every lease
        # issued, compared with every lease pulled.
        self.fingerprint = fingerprint
        self.shape = shape
        self.block_size = shape.block_size
        self.role = config.kv_role
        self.engine_id = engine_id or f"pdpool-{uuid.uuid4().hex[:12]}"
        # New at every start: a lease granted by an earlier life of this engine is void.
        self.epoch = uuid.uuid4().hex
        self.secret = secret
        # Lease metadata only: the scheduler holds the leased blocks until a lease ends.
        self.leases = LeaseTable(
            self.epoch, config.kv_producer_timeout, config.kv_load_timeout + HANDSHAKE_TIMEOUT_S
        )
        self.allowlist = parse_allowlist(config.kv_peer_allowlist)
        self.transport = NixlTransport(self.engine_id, host=config.kv_host)
        self.transport.register_region("kv", kv_cache)
        if shape.has_state:
            # Recurrent states (running slots and snapshots) travel with the blocks.
            from pdpool.engine.runner import state_tensors

            self.transport.register_region("state", state_tensors(state))
        self.document = document_for(self.transport, layout, self.epoch)
        self.desk = LeaseDesk(self.leases, self.document, self.epoch, config.kv_load_timeout)
        self.server = HandshakeServer(
            self.document,
            host=config.kv_host,
            port=config.kv_port,
            lease_handler=self.desk.answer,
        )
        self.host, self.port = config.kv_host, self.server.port
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.peer_leases = PeerLeases(self.allowlist, self.counters)
        self.loads = Loads(
            config, shape, self.transport, layout, self.allowlist, self.peer_leases, self.counters
        )
        self._announce()

    def _announce(self) -> None:
        log.info(
            "NIXL connector %s (epoch %s): handshake on %s:%d, role %s, peers allowed: %s",
            self.engine_id,
            self.epoch[:8],
            self.host,
            self.port,
            self.role,
            self.allowlist.describe(),
        )
        if self.secret is None:
            log.warning(
                "no KV secret (--kv-secret-file / $%s): kv_transfer_params are not "
                "authenticated; KV is loaded only from a live lease whose block hashes "
                "equal this engine's own for the prompt",
                SECRET_ENV,
            )

    # --- scheduler side -----------------------------------------------------------------
    def _wants_remote(self, p: Optional[dict]) -> bool:
        if not p:
            return False
        if p.get("do_remote_prefill"):
            return True
        return bool(
            p.get("do_remote_decode") and p.get("remote_block_ids") and p.get("remote_num_tokens")
        )

    def check_request(self, request: Request) -> Optional[str]:
        """Refuses, before anything is allocated or any peer contacted, params that name KV
        this engine cannot trust: no lease, a bad or missing signature (with a secret), an
        expired lease, or a lease over other tokens than this prompt's."""
        p = request.kv_transfer_params
        if p is None or not self._wants_remote(p):
            return None
        try:
            token = read_lease(p, self.secret)
            peer = self._parse_peer(p)
            if peer is None:
                raise LeaseTokenError("kv_transfer_params name no valid remote_host/remote_port")
            mine = prefix_hash(
                request.all_token_ids,
                request.block_hashes,
                token.num_tokens,
                self.block_size,
                request.hasher.extra_keys,
            )
            # A lease without one comes from an engine before fingerprints (unsigned
            # forgeries are stopped by the content and lease checks that follow).
            if token.fingerprint and token.fingerprint != self.fingerprint:
                self.counters["fingerprint_mismatches"] += 1
                raise LeaseTokenError(
                    f"the KV lease {token.lease_id} holds KV of another model, revision or "
                    "KV layout (its fingerprint differs): recomputing"
                )
            if mine != token.prefix_hash:
                self.counters["content_mismatches"] += 1
                raise LeaseTokenError(
                    f"the KV lease {token.lease_id} holds other tokens than "
                    "this prompt (its prefix hash differs)"
                )
        except LeaseTokenError as exc:
            self.counters["params_refused"] += 1
            request.kv_consumed = True  # never load from these params
            log.warning("request %s: refusing kv_transfer_params: %s", request.request_id, exc)
            return str(exc)
        request.kv_lease = token
        self.peer_leases.want(request, peer, token)
        return None

    def will_load_state(self, request: Request) -> bool:
        p = request.kv_transfer_params
        return bool(
            self.shape.has_state
            and p
            and not request.kv_consumed
            and getattr(request, "kv_lease", None) is not None
            and state_slots_of(p.get("remote_block_ids"), self.shape.num_groups)
        )

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> int:
        p = request.kv_transfer_params
        token = getattr(request, "kv_lease", None)
        if not p or request.kv_consumed or token is None:
            return 0
        gain = self._gain(request, p, token, num_local_computed)
        if gain <= 0:
            # Not pulling after all: the peer need not hold anything for us.
            request.kv_consumed = True
            self.peer_leases.drop(request.request_id)
            return 0
        return gain

    def _gain(self, request: Request, p: dict, token: LeaseToken, num_local: int) -> int:
        if self.shape.has_state and not state_slots_of(
            p.get("remote_block_ids"), self.shape.num_groups
        ):
            return 0  # without the peer's state a recurrent model cannot resume
        if p.get("do_remote_prefill"):
            if self.role == "producer":
                return 0
            threshold = 1
        else:
            if self.role == "consumer":
                return 0
            threshold = max(1, self.config.kv_pull_threshold)
        available = min(token.num_tokens, request.num_tokens - 1)  # the last token is ours
        gain = available - num_local
        return gain if gain >= threshold else 0

    def update_state_after_alloc(
        self,
        request: Request,
        allocated: AllocatedKV,
        num_local_computed: int,
        num_external: int,
    ) -> None:
        token: LeaseToken = request.kv_lease
        peer = self.peer_leases.take(request.request_id) or self._parse_peer(
            request.kv_transfer_params or {}
        )
        if peer is None:
            raise RuntimeError(f"{request.request_id}: a load planned without a peer")
        host, port = peer
        request.kv_consumed = True  # never pull twice for one request
        first = num_local_computed // self.block_size
        last = -(-(num_local_computed + num_external) // self.block_size)
        plan = LoadPlan(
            request.request_id,
            host,
            port,
            token,
            [t[first:last] for t in allocated.block_tables],
            first,
            list(request.block_hashes),
            # check_request found the prompt's own prefix hash equal to this one
            token.prefix_hash,
            num_external,
        )
        if allocated.state_slot is not None:
            plan.wants_state = True
            plan.state_pair = (allocated.state_slot, None)
            if allocated.boundary_snapshot is not None:
                local, block_hash = allocated.boundary_snapshot
                plan.boundary_snapshot = (local, None, block_hash)
        self.loads.plan(plan)

    def request_finished(
        self, request: Request, status: RequestStatus, finished: FinishedKV
    ) -> Handoff:
        self.peer_leases.drop(request.request_id)
        normal = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if not normal or not request.is_prefill_leg or self.role == "consumer":
            return Handoff()
        # Hold the prompt's blocks under a lease for the decode engine's READ, with the
        # handed-over state and the snapshot at the last block boundary (for later turns).
        num_tokens = request.num_prompt_tokens
        num_blocks = -(-num_tokens // self.block_size)
        slots: tuple[int, ...] = ()
        if finished.transfer_state_slot is not None:
            slots = (finished.transfer_state_slot,)
            if finished.boundary_snapshot_slot is not None:
                slots += (finished.boundary_snapshot_slot,)
        # The handed-over state is at the last prompt token but one (decode computes the
        # last one itself).
        lease = self.leases.grant_new(
            uuid.uuid4().hex,
            request,
            [list(t[:num_blocks]) for t in finished.block_tables],
            num_tokens,
            self.block_size,
            slots,
            num_tokens - 1,
        )
        return Handoff(
            self._describe(request, lease, do_remote_prefill=True),
            BlockHold(lease.lease_id, num_tokens, slots),
        )

    def describe_rejected(self, request: Request, prefix: CachedPrefix) -> Handoff:
        """The prefix this engine caches for a request it rejects, held under a short lease
        for a prefill engine to pull. Prefill legs are never rejected, so never described."""
        num_cached = prefix.num_tokens
        if not num_cached or self.role == "producer":
            return Handoff()
        slots: tuple[int, ...] = ()
        if self.shape.has_state:
            if prefix.snapshot_slot is None:
                return Handoff()
            slots = (prefix.snapshot_slot,)
        lease = self.leases.grant_new(
            uuid.uuid4().hex,
            request,
            [list(t) for t in prefix.block_tables],
            num_cached,
            self.block_size,
            slots,
            num_cached,
        )
        return Handoff(
            self._describe(request, lease, do_remote_prefill=False, num_tokens=num_cached),
            BlockHold(lease.lease_id, num_cached, slots),
        )

    def request_aborted(self, request: Request) -> bool:
        self.peer_leases.drop(request.request_id)
        return self.loads.abort(request)

    def release_lease(self, params: Any) -> bool:
        """Ends a lease this engine granted, named by the params it issued (a router whose
        prefill leg did not pull decode's prefix gives it back at once)."""
        if not isinstance(params, dict):
            return False
        try:
            token = read_lease(params, self.secret)
        except LeaseTokenError:
            return False
        return token.epoch == self.epoch and self.leases.release(token.lease_id)

    # --- worker side --------------------------------------------------------------------
    def start_loads(self) -> None:
        self.loads.start()

    def poll(self) -> TransferReport:
        loads = self.loads.poll()
        self.peer_leases.renew_due()
        self._collect_notifications()
        return TransferReport(
            loads,
            self.loads.take_aborted_reads_ended(),
            [lease.lease_id for lease in self.leases.take_ended()],
        )

    def stats(self) -> dict[str, float]:
        return {
            **self.counters,
            **self.leases.counters,
            "bytes_read": self.transport.bytes_read,
            "leases_active": len(self.leases),
            "loads_in_flight": len(self.loads),
        }

    def close(self) -> None:
        self.leases.take_all()
        self.loads.close()
        self.peer_leases.close()
        self.server.close()
        self.transport.close()

    # --- helpers ------------------------------------------------------------------------
    def _parse_peer(self, p: dict) -> Optional[tuple[str, int]]:
        host, port = p.get("remote_host"), p.get("remote_port")
        if (
            not isinstance(host, str)
            or not host
            or isinstance(port, bool)
            or not isinstance(port, int)
            or not 0 < port < 65536
        ):
            return None
        return host, port

    def _describe(
        self,
        request: Request,
        lease: Lease,
        do_remote_prefill: bool,
        num_tokens: Optional[int] = None,
    ) -> dict:
        ids: list[list[int]] = [list(t) for t in lease.block_ids]
        if lease.state_slots:
            ids.append(list(lease.state_slots))  # state slots, after the attention groups
        params = {
            "do_remote_prefill": do_remote_prefill,
            "do_remote_decode": not do_remote_prefill,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            # One list for one group (vLLM's shape), else one list per group.
            "remote_block_ids": ids[0] if len(ids) == 1 else ids,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
        }
        if num_tokens is not None:
            params["remote_num_tokens"] = num_tokens
        expires_ms = int((time.time() + self.config.kv_producer_timeout) * 1000)
        digest = lease.prefix_hash  # computed once, when the lease was granted
        if digest is None:
            raise RuntimeError(f"no prefix hash for the {lease.num_tokens} leased tokens")
        token = LeaseToken(
            lease.lease_id, self.epoch, lease.num_tokens, digest, expires_ms, self.fingerprint
        )
        return attach_lease(params, token, self.secret)

    def _collect_notifications(self) -> None:
        for note in self.transport.notifications():
            self.leases.release(note.message.decode(errors="replace"))
