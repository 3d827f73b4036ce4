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
Everything here runs on the engine thread, except network I/O with peers (a small pool)
and the answers to peers' lease operations (the handshake server's threads, which touch
only the lease table).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from pdpool.engine.config import EngineConfig
from pdpool.engine.connector.allowlist import parse_allowlist, resolve_allowed
from pdpool.engine.connector.base import KVConnector, LoadResult
from pdpool.engine.connector.handshake import (
    HandshakeDocument,
    HandshakeError,
    HandshakeServer,
    document_for,
    lease_call,
)
from pdpool.engine.connector.lease_token import SECRET_ENV, LeaseToken, LeaseTokenError
from pdpool.engine.connector.lease_token import attach as attach_lease
from pdpool.engine.connector.lease_token import read as read_lease
from pdpool.engine.connector.nixl_transport import NixlTransport, TransferState
from pdpool.engine.connector.peering import admit_peer
from pdpool.engine.kv.block_pool import Block
from pdpool.engine.kv.hashing import prefix_hash
from pdpool.engine.kv.leases import Lease, LeaseRefused
from pdpool.engine.kv.manager import KVCacheManager, cdiv
from pdpool.engine.request import Request, RequestStatus

log = logging.getLogger("pdpool.connector")

HANDSHAKE_TIMEOUT_S = 5.0
HOUSEKEEPING_TIMEOUT_S = 2.0  # renewals and releases: a later one, or expiry, covers a miss
FIRST_RENEWAL_S = 0.05  # a queued request's first renewal


@dataclass
class LoadPlan:
    request_id: str
    host: str
    port: int
    token: LeaseToken  # the lease named by the params (checked on admission)
    local_tables: list[list[int]]  # per KV group, the blocks at the pulled positions
    first_position: int  # block position of local_tables[g][0]
    own_hashes: list[bytes]  # our chained hashes of the prompt (for the content check)
    own_prefix_hash: Optional[bytes]  # ours at the lease's token count, if the prompt reaches
    num_external: int  # tokens the plan would bring
    wants_state: bool = False
    started: float = field(default_factory=time.monotonic)
    opening: Optional[Future] = None
    transfer_id: Optional[int] = None
    num_valid_positions: int = 0
    state_pair: Optional[tuple[int, Any]] = None  # (local running slot, remote state slot)
    # A peer's snapshot at the last block boundary before the pulled state, copied into a
    # local snapshot slot and published under that block's hash once it has arrived, so a
    # later turn can hit this prefix here: (local slot, remote slot, block hash).
    boundary_snapshot: Optional[tuple[int, Any, bytes]] = None
    boundary_hash: Optional[bytes] = None
    orphan_blocks: Optional[list[Block]] = None  # request aborted mid-READ

    @property
    def read_id(self) -> int:
        """The READ's transfer id (plans in `_reading` always have one)."""
        if self.transfer_id is None:
            raise RuntimeError(f"load for {self.request_id} has no READ")
        return self.transfer_id


@dataclass
class _Wanted:
    """A request that names a peer's lease and has not started loading: kept alive."""

    request: Request
    key: tuple[str, int]
    token: LeaseToken
    next_renewal: float = 0.0  # monotonic
    renewing: Optional[Future] = None

    def schedule(self, remaining_s: float) -> None:
        """Renews at a third of the remaining hold, so two renewals may fail in a row."""
        self.next_renewal = time.monotonic() + max(remaining_s / 3, 0.1)


def _state_slots_of(value: Any, num_groups: int) -> Optional[list]:
    """The state slots a description carries after the attention groups' lists: the state
    at the end of the described tokens, then optionally the snapshot at the last block
    boundary before it."""
    if (
        isinstance(value, list)
        and len(value) == num_groups + 1
        and isinstance(value[num_groups], list)
        and 1 <= len(value[num_groups]) <= 2
    ):
        return value[num_groups]
    return None


def verified_positions(
    first: int,
    last: int,
    consumer_end: int,
    lease: dict,
    own_hashes: list[bytes],
    own_prefix_hash: Optional[bytes],
    block_size: int,
) -> int:
    """How many block positions from `first` (up to `last`) the consumer may load: each must
    hold, on the producer, exactly the tokens the consumer would compute there, which the
    chained hashes prove (a full block by its hash, the lease's final partial block by the
    hash of the whole leased prefix). Counting stops at the first block that fails."""
    num_tokens = int(lease["num_tokens"])
    hashes = lease["hashes"]
    tail = lease.get("tail_hash")
    n = 0
    for p in range(first, last):
        used_end = min((p + 1) * block_size, consumer_end)  # tokens we take from block p
        if used_end > num_tokens:
            break  # the producer does not hold all of them
        if (p + 1) * block_size <= num_tokens:
            ok = p < len(hashes) and p < len(own_hashes) and hashes[p] == own_hashes[p].hex()
        else:
            ok = tail is not None and own_prefix_hash is not None and tail == own_prefix_hash.hex()
        if not ok:
            break
        n += 1
    return n


class NixlConnector(KVConnector):
    name = "nixl"

    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        kv_cache,
        layout: dict,
        state=None,
        engine_id: Optional[str] = None,
        secret: Optional[bytes] = None,
    ):
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self.role = config.kv_role
        self.engine_id = engine_id or f"pdpool-{uuid.uuid4().hex[:12]}"
        # New at every start: a lease granted by an earlier life of this engine is void.
        self.epoch = uuid.uuid4().hex
        self.secret = secret
        self.leases = kv.configure_leases(
            self.epoch, config.kv_producer_timeout, config.kv_load_timeout + HANDSHAKE_TIMEOUT_S
        )
        self.layout = layout
        self.sliding = [g.is_sliding for g in kv.groups]
        self.allowlist = parse_allowlist(config.kv_peer_allowlist)
        self.transport = NixlTransport(self.engine_id)
        self.transport.register_region("kv", kv_cache)
        if kv.has_state:
            # Recurrent states (running slots and snapshots) travel with the blocks.
            from pdpool.engine.runner import state_tensors

            self.transport.register_region("state", state_tensors(state))
        self.document = document_for(self.transport, layout, self.epoch)
        self.server = HandshakeServer(
            self.document,
            host=config.kv_host,
            port=config.kv_port,
            lease_handler=self._answer_lease_op,
        )
        self.host, self.port = config.kv_host, self.server.port
        # Opens (on the load path) and renewals/releases (housekeeping) on separate pools,
        # so a peer that stopped answering cannot hold up loads from the others.
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-lease")
        self._housekeeping = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-lease-hk")
        self._peers: dict[tuple[str, int], str] = {}  # (host, port) -> agent name
        self._waiting: dict[str, LoadPlan] = {}  # planned, READ not started
        self._reading: dict[str, LoadPlan] = {}  # READ in flight
        self._wanted: dict[str, _Wanted] = {}  # leases we will load from
        self._failed: list[LoadResult] = []
        self.counters = {
            "loads_ok": 0,
            "loads_failed": 0,
            "tokens_pulled": 0,
            "peers_refused": 0,
            "peers_replaced": 0,
            "params_refused": 0,
            "content_mismatches": 0,
            "lease_renewals_sent": 0,
            "lease_releases_sent": 0,
        }
        log.info(
            "NIXL connector %s (epoch %s): handshake on %s:%d, role %s, peers allowed: %s",
            self.engine_id,
            self.epoch[:8],
            self.host,
            self.port,
            self.role,
            self.allowlist.describe(),
        )
        if secret is None:
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
        wanted = _Wanted(request, peer, token)
        # A request admitted at once opens the lease before this; one that waits renews
        # early, whatever the producer's clock says is left.
        wanted.schedule(min(token.expires_ms / 1000 - time.time(), FIRST_RENEWAL_S * 3))
        self._wanted[request.request_id] = wanted
        return None

    def will_load_state(self, request: Request) -> bool:
        p = request.kv_transfer_params
        return bool(
            self.kv.has_state
            and p
            and not request.kv_consumed
            and getattr(request, "kv_lease", None) is not None
            and _state_slots_of(p.get("remote_block_ids"), len(self.kv.groups))
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
            self._drop_wanted(request.request_id, release=True)
            return 0
        return gain

    def _gain(self, request: Request, p: dict, token: LeaseToken, num_local: int) -> int:
        if self.kv.has_state and not _state_slots_of(
            p.get("remote_block_ids"), len(self.kv.groups)
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
        block_tables: list[list[int]],
        num_local_computed: int,
        num_external: int,
    ) -> None:
        token: LeaseToken = request.kv_lease
        wanted = self._wanted.pop(request.request_id, None)
        peer = (
            wanted.key if wanted is not None else self._parse_peer(request.kv_transfer_params or {})
        )
        if peer is None:
            raise RuntimeError(f"{request.request_id}: a load planned without a peer")
        host, port = peer
        request.kv_consumed = True  # never pull twice for one request
        first = num_local_computed // self.block_size
        last = cdiv(num_local_computed + num_external, self.block_size)
        plan = LoadPlan(
            request.request_id,
            host,
            port,
            token,
            [t[first:last] for t in block_tables],
            first,
            list(request.block_hashes),
            # check_request found the prompt's own prefix hash equal to this one
            token.prefix_hash,
            num_external,
        )
        if wanted is not None and wanted.renewing is not None:
            wanted.renewing.cancel()
        if self.kv.has_state:
            plan.wants_state = True
            plan.state_pair = (self.kv.state_slot(request.request_id), None)
            boundary = (num_local_computed + num_external) // self.block_size
            if boundary and not self.kv.has_snapshot(request.block_hashes[boundary - 1]):
                local = self.kv.reserve_snapshot_slot()
                if local is not None:
                    plan.boundary_snapshot = (local, None, request.block_hashes[boundary - 1])
        self._waiting[request.request_id] = plan

    def request_finished(self, request: Request, status: RequestStatus) -> Optional[dict]:
        self._drop_wanted(request.request_id, release=True)
        normal = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if not normal:
            return None
        if request.is_prefill_leg and self.role != "consumer":
            # Hold the prompt's blocks under a lease for the decode engine's READ.
            tables = self.kv.blocks_of(request, request.num_prompt_tokens)
            slots = []
            handed = request.transfer_state_slot
            if handed is not None:
                slots.append(handed)
                # Also offer the snapshot at the last block boundary, for later turns.
                boundary = (request.num_prompt_tokens - 1) // self.block_size
                snap = self.kv.snapshot_at(request.block_hashes[boundary - 1]) if boundary else None
                if snap is not None:
                    slots.append(snap)
            # The handed-over state is at the last prompt token but one (decode computes
            # the last one itself).
            lease = self.kv.grant_lease(
                uuid.uuid4().hex,
                request,
                tables,
                request.num_prompt_tokens,
                tuple(slots),
                request.num_prompt_tokens - 1,
            )
            if handed is not None:
                # The lease holds the handed-over state now; drop the request's own pin.
                request.transfer_state_slot = None
                self.kv.release_snapshot_slot(handed)
            return self._describe(request, lease, do_remote_prefill=True)
        return None

    def describe_rejected(
        self, request: Request, hits: list[list[Block]], num_cached: int
    ) -> Optional[dict]:
        """The prefix this engine caches for a request it rejects, held under a short lease
        for a prefill engine to pull. Prefill legs are never rejected, so never described."""
        if not num_cached or self.role == "producer":
            return None
        slots: tuple[int, ...] = ()
        if self.kv.has_state:
            slot = self.kv.snapshot_at(request.block_hashes[num_cached // self.block_size - 1])
            if slot is None:
                return None
            slots = (slot,)
        lease = self.kv.grant_lease(uuid.uuid4().hex, request, hits, num_cached, slots, num_cached)
        return self._describe(request, lease, do_remote_prefill=False, num_tokens=num_cached)

    def request_aborted(self, request: Request) -> None:
        rid = request.request_id
        self._drop_wanted(rid, release=True)
        waiting = self._waiting.pop(rid, None)
        if waiting is not None:
            self._abandon(waiting)
        plan = self._reading.get(rid)
        if plan is not None:
            # The READ may still write into these blocks: keep them until it ends.
            plan.orphan_blocks = self.kv.detach(request)

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

    # --- the producer's answers to peers (handshake server threads) ---------------------
    def _answer_lease_op(self, message: dict) -> dict:
        try:
            return self._lease_op(message)
        except Exception as exc:  # a malformed message must not cost the server a thread
            log.warning("bad KV lease op from a peer: %r", exc)
            return {"ok": False, "error": "malformed lease op"}

    def _lease_op(self, message: dict) -> dict:
        op, lease_id, epoch = message.get("op"), message.get("lease_id"), message.get("epoch")
        if not isinstance(lease_id, str) or not isinstance(epoch, str):
            return {"ok": False, "error": "a lease op names lease_id and epoch"}
        try:
            if op == "open":
                timeout = message.get("read_timeout_s")
                timeout = (
                    float(timeout)
                    if isinstance(timeout, (int, float))
                    and not isinstance(timeout, bool)
                    and math.isfinite(timeout)
                    else self.config.kv_load_timeout
                )
                reply = {
                    "ok": True,
                    "lease": self.leases.open(lease_id, epoch, timeout),
                    "agent_name": self.transport.agent_name,
                    "epoch": self.epoch,
                }
                if message.get("known_agent") != self.transport.agent_name:
                    reply["peer"] = self.document.to_json()
                return reply
            if op == "renew":
                return {"ok": True, "held_s": self.leases.renew(lease_id, epoch)}
            if op == "release":
                return {"ok": epoch == self.epoch and self.leases.release(lease_id)}
        except LeaseRefused as exc:
            return {"ok": False, "error": str(exc), "epoch": self.epoch}
        return {"ok": False, "error": f"unknown lease op {op!r}"}

    # --- worker side --------------------------------------------------------------------
    def start_loads(self) -> None:
        for plan in list(self._waiting.values()):
            if plan.opening is None:
                self._open(plan)

    def poll(self) -> list[LoadResult]:
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
                self._send_release(plan.host, plan.port, plan.token)
                self._forget_peer((plan.host, plan.port))
            if plan.orphan_blocks is not None:
                self.kv.release(plan.orphan_blocks)
                self._drop_boundary_snapshot(plan)
                continue
            results.append(self._result(plan, error, arrived))
        self._renew_wanted()
        self._collect_notifications()
        self.kv.end_leases()
        return results

    def stats(self) -> dict[str, float]:
        return {
            **self.counters,
            **self.leases.counters,
            "bytes_read": self.transport.bytes_read,
            "leases_active": len(self.leases),
            "loads_in_flight": len(self._reading) + len(self._waiting),
        }

    def close(self) -> None:
        self.kv.end_leases(everything=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._housekeeping.shutdown(wait=False, cancel_futures=True)
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
        token = LeaseToken(lease.lease_id, self.epoch, lease.num_tokens, digest, expires_ms)
        return attach_lease(params, token, self.secret)

    def _drop_wanted(self, request_id: str, release: bool) -> None:
        wanted = self._wanted.pop(request_id, None)
        if wanted is None:
            return
        if wanted.renewing is not None:
            wanted.renewing.cancel()
        if release:
            self._send_release(*wanted.key, wanted.token)

    def _renew_wanted(self) -> None:
        """Keeps the leases of requests still queued here alive on their producers."""
        now = time.monotonic()
        for rid, w in list(self._wanted.items()):
            if w.request.is_finished:
                self._drop_wanted(rid, release=True)
                continue
            if w.renewing is not None:
                if not w.renewing.done():
                    continue
                try:
                    reply = w.renewing.result()
                except Exception:  # unreachable this time: try again soon
                    reply = {"ok": True, "held_s": 0.3}
                w.renewing = None
                held = reply.get("held_s")
                if not reply.get("ok") or not isinstance(held, (int, float)):
                    continue  # the lease is gone: the open will say so and we recompute
                w.schedule(float(held))
            if now >= w.next_renewal:
                w.next_renewal = float("inf")  # until the answer reschedules
                self.counters["lease_renewals_sent"] += 1
                w.renewing = self._submit_lease_op(
                    w.key, {"op": "renew", "lease_id": w.token.lease_id, "epoch": w.token.epoch}
                )

    def _submit_lease_op(self, key: tuple[str, int], message: dict) -> Optional[Future]:
        try:
            address = resolve_allowed(key[0], self.allowlist)
        except PermissionError:
            return None
        return self._housekeeping.submit(
            lease_call, address, key[1], message, HOUSEKEEPING_TIMEOUT_S
        )

    def _send_release(self, host: str, port: int, token: LeaseToken) -> None:
        self.counters["lease_releases_sent"] += 1
        self._submit_lease_op(
            (host, port), {"op": "release", "lease_id": token.lease_id, "epoch": token.epoch}
        )

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
            "known_agent": self._peers.get(key),
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
                agent = self._peer_from_reply((plan.host, plan.port), reply)
            except Exception as exc:  # I/O, a refused lease, an incompatible peer, NIXL
                self._failed.append(self._result(plan, str(exc)))
                continue
            self._start_read(agent, plan, reply["lease"])

    def _peer_from_reply(self, key: tuple[str, int], reply: dict) -> str:
        """The NIXL agent to read from, as the producer names it in its answer; a new name
        (the producer restarted) replaces the old agent, so transfers heal at once."""
        if not reply.get("ok"):
            raise HandshakeError(
                f"KV lease refused by {key[0]}:{key[1]}: {reply.get('error', 'no reason given')}"
            )
        agent = reply.get("agent_name")
        if isinstance(agent, str) and agent == self._peers.get(key) and "peer" not in reply:
            return agent
        if not isinstance(reply.get("peer"), dict):
            raise HandshakeError(f"KV peer {key[0]}:{key[1]} did not describe its agent")
        doc = HandshakeDocument.from_json(reply["peer"])
        if doc.agent_name != agent or doc.epoch != reply.get("epoch"):
            raise HandshakeError(f"KV peer {key[0]}:{key[1]}: inconsistent agent or epoch")
        old = self._peers.pop(key, None)
        if old is not None and old != agent:
            self.counters["peers_replaced"] += 1
            log.info(
                "KV peer %s:%d restarted (epoch %s): new NIXL agent", key[0], key[1], doc.epoch[:8]
            )
            self._remove_agent(old)
        try:
            self._peers[key] = admit_peer(self.transport, doc, self.layout, f"{key[0]}:{key[1]}")
        except HandshakeError:
            self.counters["peers_refused"] += 1
            raise
        return self._peers[key]

    def _forget_peer(self, key: tuple[str, int]) -> None:
        """After a failed read: the next load asks the producer for its agent again."""
        agent = self._peers.pop(key, None)
        if (
            agent is not None
            and agent not in self._peers.values()
            and not any(
                self.transport.transfer(p.read_id).peer == agent for p in self._reading.values()
            )
        ):
            self._remove_agent(agent)

    def _remove_agent(self, agent: str) -> None:
        try:
            self.transport.remove_peer(agent)
        except Exception as exc:  # already gone
            log.debug("removing NIXL agent %s: %s", agent, exc)

    def _start_read(self, agent: str, plan: LoadPlan, lease: dict) -> None:
        bs = self.block_size
        num_positions = len(plan.local_tables[0]) if plan.local_tables else 0
        first, last = plan.first_position, plan.first_position + num_positions
        consumer_end = plan.first_position * bs + plan.num_external
        try:
            remote_tables = [list(t) for t in lease["block_ids"]]
            slots = list(lease.get("state_slots") or [])
            valid = verified_positions(
                first, last, consumer_end, lease, plan.own_hashes, plan.own_prefix_hash, bs
            )
        except (KeyError, TypeError, ValueError) as exc:
            self._failed.append(self._result(plan, f"malformed lease from the peer: {exc!r}"))
            self._send_release(plan.host, plan.port, plan.token)
            return
        if valid < num_positions:
            self.counters["content_mismatches"] += 1
        remote_units = self.transport.peer_regions(agent)["kv"].num_units
        for g, remote in enumerate(remote_tables[: len(plan.local_tables)]):
            for k in range(valid):
                rid = remote[first + k] if first + k < len(remote) else None
                if isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid < remote_units:
                    valid = k
                    break
        if plan.wants_state:
            # A state resumes exactly where it was taken: all blocks up to there, or nothing.
            whole = consumer_end == lease.get("state_tokens") and valid == num_positions
            if not slots or not whole:
                valid = 0
        plan.num_valid_positions = valid
        local_ids, remote_ids = [], []
        for g, (local, remote) in enumerate(zip(plan.local_tables, remote_tables)):
            for k in range(min(valid, len(local))):
                if self.sliding[g] and (remote[first + k] == 0 or local[k] == 0):
                    continue  # a null block (outside the window) on either side
                local_ids.append(local[k])
                remote_ids.append(remote[first + k])
        units = {"kv": (local_ids, remote_ids)}
        if plan.state_pair is not None and valid:
            plan.state_pair = (plan.state_pair[0], slots[0])
            units["state"] = ([plan.state_pair[0]], [slots[0]])
            if plan.boundary_snapshot is not None and len(slots) == 2:
                local_slot, _, block_hash = plan.boundary_snapshot
                plan.boundary_snapshot = (local_slot, slots[1], block_hash)
                units["state"][0].append(local_slot)
                units["state"][1].append(slots[1])
        try:
            # The notification names the lease: the producer ends it on arrival.
            plan.transfer_id = self.transport.start_read(
                agent,
                units,
                notification=plan.token.lease_id,
                timeout_s=self.config.kv_load_timeout,
            )
        except Exception as exc:
            self._send_release(plan.host, plan.port, plan.token)
            self._failed.append(self._result(plan, f"READ refused: {exc}"))
            return
        self._reading[plan.request_id] = plan

    def _abandon(self, plan: LoadPlan) -> None:
        if plan.opening is not None:
            plan.opening.cancel()
        self._send_release(plan.host, plan.port, plan.token)
        self._drop_boundary_snapshot(plan)

    def _result(self, plan: LoadPlan, error: Optional[str], arrived: bool = False) -> LoadResult:
        """`arrived`: the READ completed, so the verified prefix of the blocks is here."""
        loaded = (
            min(plan.num_external, plan.num_valid_positions * self.block_size) if arrived else 0
        )
        wanted = len(plan.local_tables[0]) if plan.local_tables else 0
        if arrived and plan.num_valid_positions < wanted:
            error = (
                f"only {plan.num_valid_positions} of {wanted} leased blocks hold this "
                "prompt's tokens"
            )
        restart = False
        self._drop_boundary_snapshot(plan, publish=arrived and error is None)
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
        return LoadResult(plan.request_id, loaded, error, restart)

    def _drop_boundary_snapshot(self, plan: LoadPlan, publish: bool = False) -> None:
        if plan.boundary_snapshot is None:
            return
        slot, remote, block_hash = plan.boundary_snapshot
        plan.boundary_snapshot = None
        if publish and remote is not None:
            self.kv.publish_snapshot(block_hash, slot)
        self.kv.release_snapshot_slot(slot)

    def _collect_notifications(self) -> None:
        for note in self.transport.notifications():
            self.leases.release(note.message.decode(errors="replace"))
