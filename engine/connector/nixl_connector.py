"""The NIXL KV connector: P/D transfer in both directions, with recovery from failed loads.

Directions (the `kv_transfer_params` contract, wire-compatible with vLLM's NixlConnector):
- a prefill leg (`do_remote_decode`) finishes with its blocks held for the decode engine
  and answers where they are (`do_remote_prefill: true`, engine id, host, port, block ids);
- a decode leg (`do_remote_prefill`) READs the blocks it does not already cache and
  computes only what is left (the last prompt token);
- bidirectional: a decode engine that rejects a request (cache-hit threshold) describes the
  prefix it caches (`do_remote_decode: true`, `remote_block_ids`, `remote_num_tokens`) and
  holds those blocks for a while; a prefill engine given such a description READs that
  prefix instead of recomputing it when it gains at least `--kv-pull-threshold` tokens.

A READ carries the peer's request id as its NIXL notification; the peer frees what it held
on receipt, or after `--kv-producer-timeout` if nobody reads. A load that fails (peer gone,
outside the allowlist, incompatible, bogus block ids, timeout) is reported with the tokens
that did arrive, so the scheduler recomputes only from the first missing block.
Everything here runs on the engine thread, except handshakes (network I/O, on a pool).
"""
from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from pdpool.engine.config import EngineConfig
from pdpool.engine.connector.allowlist import parse_allowlist, resolve_allowed
from pdpool.engine.connector.base import KVConnector, LoadResult
from pdpool.engine.connector.handshake import (HandshakeServer, check_compatible,
                                               document_for, fetch_handshake)
from pdpool.engine.connector.nixl_transport import NixlTransport, TransferState
from pdpool.engine.kv.block_pool import Block
from pdpool.engine.kv.manager import KVCacheManager, cdiv
from pdpool.engine.request import Request, RequestStatus

log = logging.getLogger("pdpool.connector")

HANDSHAKE_TIMEOUT_S = 5.0


@dataclass
class LoadPlan:
    request_id: str
    host: str
    port: int
    remote_request_id: str
    local_tables: list[list[int]]   # per KV group, the blocks at the pulled positions
    remote_tables: list[list]       # as received: validated when the peer is known
    num_external: int               # tokens the plan would bring
    started: float = field(default_factory=time.monotonic)
    transfer_id: Optional[int] = None
    num_valid_positions: int = 0
    state_pair: Optional[tuple[int, Any]] = None  # (local running slot, remote state slot)
    # A peer's snapshot at the last block boundary before the pulled state, copied into a
    # local snapshot slot and published under that block's hash once it has arrived, so a
    # later turn can hit this prefix here: (local slot, remote slot, block hash).
    boundary_snapshot: Optional[tuple[int, Any, bytes]] = None
    orphan_blocks: Optional[list[Block]] = None  # request aborted mid-READ


@dataclass
class Lease:
    blocks: list[Block]
    deadline: float
    state_slots: tuple[int, ...] = ()   # pinned recurrent-state slots


def _block_id_tables(value: Any, num_groups: int) -> list[list]:
    """remote_block_ids is one list (one KV group, vLLM's shape) or one list per group."""
    if not isinstance(value, list):
        return [[] for _ in range(num_groups)]
    if value and isinstance(value[0], list):
        return [list(t) if isinstance(t, list) else [] for t in value[:num_groups]] + \
            [[] for _ in range(num_groups - len(value))]
    return [value] + [[] for _ in range(num_groups - 1)]


class NixlConnector(KVConnector):
    name = "nixl"

    def __init__(self, config: EngineConfig, kv: KVCacheManager, kv_cache, layout: dict,
                 state=None, engine_id: Optional[str] = None):
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self.role = config.kv_role
        self.engine_id = engine_id or f"pdpool-{uuid.uuid4().hex[:12]}"
        self.layout = layout
        self.sliding = [g.kind == "sliding" for g in kv.groups]
        self.allowlist = parse_allowlist(config.kv_peer_allowlist)
        self.transport = NixlTransport(self.engine_id)
        self.transport.register_region("kv", kv_cache)
        if kv.has_state:
            # Recurrent states (running slots and snapshots) travel with the blocks.
            from pdpool.engine.runner import state_tensors
            self.transport.register_region("state", state_tensors(state))
        self.server = HandshakeServer(document_for(self.transport, layout),
                                      host=config.kv_host, port=config.kv_port)
        self.host, self.port = config.kv_host, self.server.port
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-handshake")
        self._peers: dict[tuple[str, int], str] = {}          # (host, port) -> agent name
        self._handshakes: dict[tuple[str, int], Future] = {}
        self._waiting: dict[str, LoadPlan] = {}               # planned, READ not started
        self._reading: dict[str, LoadPlan] = {}               # READ in flight
        self._failed: list[LoadResult] = []
        self._leases: dict[str, Lease] = {}
        self.counters = {"loads_ok": 0, "loads_failed": 0, "tokens_pulled": 0,
                         "leases_expired": 0, "leases_released": 0, "peers_refused": 0}
        log.info("NIXL connector %s: handshake on %s:%d, role %s, peers allowed: %s",
                 self.engine_id, self.host, self.port, self.role, self.allowlist.describe())

    # --- scheduler side -----------------------------------------------------------------
    def _remote_state_slots(self, p: dict) -> Optional[list]:
        """The state slots a peer describes, in the list after the attention groups' lists:
        the state at the end of the described tokens, then optionally the snapshot at the
        last block boundary before it."""
        ids = p.get("remote_block_ids")
        n = len(self.kv.groups)
        if isinstance(ids, list) and len(ids) == n + 1 and isinstance(ids[n], list) \
                and 1 <= len(ids[n]) <= 2:
            return ids[n]
        return None

    def _remote_state_slot(self, p: dict) -> Any:
        slots = self._remote_state_slots(p)
        return slots[0] if slots else None

    def will_load_state(self, request: Request) -> bool:
        p = request.kv_transfer_params
        return bool(self.kv.has_state and p and not request.kv_consumed
                    and self._remote_state_slot(p) is not None)

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> int:
        p = request.kv_transfer_params
        if not p or request.kv_consumed:
            return 0
        if self.kv.has_state and self._remote_state_slot(p) is None:
            return 0   # without the peer's state a recurrent model cannot resume
        if p.get("do_remote_prefill"):
            if self.role == "producer":
                return 0
            available = request.num_tokens - 1      # leave the last token to compute
        elif p.get("do_remote_decode") and p.get("remote_block_ids") \
                and p.get("remote_num_tokens"):
            if self.role == "consumer":
                return 0
            try:
                available = min(int(p["remote_num_tokens"]), request.num_tokens - 1)
            except (TypeError, ValueError):
                return 0
        else:
            return 0
        gain = available - num_local_computed
        threshold = 1 if p.get("do_remote_prefill") else max(1, self.config.kv_pull_threshold)
        if gain < threshold or self._parse_peer(p) is None:
            return 0
        return gain

    def update_state_after_alloc(self, request: Request, block_tables: list[list[int]],
                                 num_local_computed: int, num_external: int) -> None:
        p = request.kv_transfer_params
        host, port = self._parse_peer(p)
        first = num_local_computed // self.block_size
        last = cdiv(num_local_computed + num_external, self.block_size)
        remote = _block_id_tables(p.get("remote_block_ids"), len(block_tables))
        request.kv_consumed = True   # never pull twice for one request
        plan = LoadPlan(request.request_id, host, port, str(p.get("remote_request_id") or ""),
                        [t[first:last] for t in block_tables], [t[first:last] for t in remote],
                        num_external)
        if self.kv.has_state:
            slots = self._remote_state_slots(p)
            plan.state_pair = (self.kv.state_slot(request.request_id), slots[0])
            boundary = (num_local_computed + num_external) // self.block_size
            if len(slots) == 2 and boundary and \
                    request.block_hashes[boundary - 1] not in self.kv.snapshots:
                local = self.kv.snapshots.take_slot()
                if local is not None:
                    self.kv.snapshots.pinned.add(local)
                    plan.boundary_snapshot = (local, slots[1], request.block_hashes[boundary - 1])
        self._waiting[request.request_id] = plan

    def request_finished(self, request: Request, status: RequestStatus) -> Optional[dict]:
        normal = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if not normal:
            return None
        if request.is_prefill_leg and self.role != "consumer":
            # Hold the prompt's blocks (an extra reference) for the decode engine's READ.
            n = cdiv(request.num_prompt_tokens, self.block_size)
            tables = [blocks[:n] for blocks in self.kv.req_blocks.get(request.request_id, [])]
            slots = []
            if request.transfer_state_slot is not None:
                slots.append(request.transfer_state_slot)
                request.transfer_state_slot = None
                # Also offer the snapshot at the last block boundary, for later turns.
                boundary = (request.num_prompt_tokens - 1) // self.block_size
                snap = self.kv.snapshots.lookup(request.block_hashes[boundary - 1]) \
                    if boundary else None
                if snap is not None:
                    self.kv.snapshots.pinned.add(snap)
                    slots.append(snap)
            self._lease(request.request_id, self.kv.hold([b for t in tables for b in t]),
                        tuple(slots))
            return self._describe(request.request_id, tables, do_remote_prefill=True,
                                  state_slots=slots)
        return None

    def describe_rejected(self, request: Request, hits: list[Block],
                          num_cached: int) -> Optional[dict]:
        """The prefix this engine caches for a request it rejects, held for a prefill
        engine to pull (seed 001). Prefill legs are never rejected, so never described."""
        if not num_cached or self.role == "producer":
            return None
        slot = None
        if self.kv.has_state:
            slot = self.kv.snapshots.lookup(request.block_hashes[num_cached // self.block_size - 1])
            if slot is None:
                return None
            self.kv.snapshots.pinned.add(slot)
        self._lease(request.request_id, self.kv.hold([b for t in hits for b in t]),
                    () if slot is None else (slot,))
        return self._describe(request.request_id, hits, do_remote_prefill=False,
                              num_tokens=num_cached, state_slots=[] if slot is None else [slot])

    def request_aborted(self, request: Request) -> None:
        rid = request.request_id
        waiting = self._waiting.pop(rid, None)
        if waiting is not None:
            self._drop_boundary_snapshot(waiting)
        plan = self._reading.get(rid)
        if plan is not None:
            # The READ may still write into these blocks: keep them until it ends.
            plan.orphan_blocks = self.kv.detach(request)

    # --- worker side --------------------------------------------------------------------
    def start_loads(self) -> None:
        for rid, plan in list(self._waiting.items()):
            key = (plan.host, plan.port)
            agent = self._peers.get(key)
            if agent is None:
                self._connect(key)
                continue
            del self._waiting[rid]
            self._start_read(agent, plan)

    def poll(self) -> list[LoadResult]:
        self._finish_handshakes()
        self.start_loads()
        results, self._failed = self._failed, []
        for rid, plan in list(self._reading.items()):
            state = self.transport.poll(plan.transfer_id)
            if state is TransferState.IN_PROGRESS:
                continue
            arrived = state is TransferState.DONE
            error = None if arrived else self.transport.transfer(plan.transfer_id).error
            self.transport.release(plan.transfer_id)
            del self._reading[rid]
            if plan.orphan_blocks is not None:
                self.kv.release(plan.orphan_blocks)
                self._drop_boundary_snapshot(plan)
                continue
            results.append(self._result(plan, error, arrived))
        self._collect_notifications()
        self._expire_leases()
        return results

    def has_pending_work(self) -> bool:
        return bool(self._waiting or self._reading or self._handshakes or self._leases)

    def stats(self) -> dict[str, float]:
        return {**self.counters, "bytes_read": self.transport.bytes_read,
                "leases_active": len(self._leases), "loads_in_flight": len(self._reading)}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.server.close()
        self.transport.close()

    # --- helpers ------------------------------------------------------------------------
    def _parse_peer(self, p: dict) -> Optional[tuple[str, int]]:
        host, port = p.get("remote_host"), p.get("remote_port")
        if not isinstance(host, str) or not host or isinstance(port, bool) \
                or not isinstance(port, int) or not 0 < port < 65536:
            return None
        return host, port

    def _describe(self, lease_id: str, tables: list[list[Block]], do_remote_prefill: bool,
                  num_tokens: Optional[int] = None, state_slots: list[int] = ()) -> dict:
        ids = [[b.block_id for b in blocks] for blocks in tables]
        if state_slots:
            ids.append(list(state_slots))   # recurrent state slots, after the attention groups
        params = {"do_remote_prefill": do_remote_prefill, "do_remote_decode": not do_remote_prefill,
                  "remote_engine_id": self.engine_id, "remote_request_id": lease_id,
                  # One list for one group (vLLM's shape), else one list per group.
                  "remote_block_ids": ids[0] if len(ids) == 1 else ids,
                  "remote_host": self.host, "remote_port": self.port, "tp_size": 1}
        if num_tokens is not None:
            params["remote_num_tokens"] = num_tokens
        return params

    def _lease(self, lease_id: str, blocks: list[Block], state_slots: tuple[int, ...] = ()) -> None:
        old = self._leases.pop(lease_id, None)
        if old is not None:
            self._end_lease(old)
        self._leases[lease_id] = Lease(blocks, time.monotonic() + self.config.kv_producer_timeout,
                                       state_slots)

    def _end_lease(self, lease: Lease) -> None:
        self.kv.release(lease.blocks)
        for slot in lease.state_slots:
            self.kv.snapshots.release(slot)

    def _connect(self, key: tuple[str, int]) -> None:
        if key in self._handshakes:
            return
        try:
            address = resolve_allowed(key[0], self.allowlist)
        except PermissionError as exc:
            self.counters["peers_refused"] += 1
            log.warning("refusing KV peer %s:%d: %s", key[0], key[1], exc)
            self._fail_plans_for(key, str(exc))
            return
        self._handshakes[key] = self._pool.submit(fetch_handshake, address, key[1],
                                                  HANDSHAKE_TIMEOUT_S)

    def _finish_handshakes(self) -> None:
        for key, fut in list(self._handshakes.items()):
            if not fut.done():
                continue
            del self._handshakes[key]
            try:
                doc = fut.result()
                check_compatible(self.layout, doc)
                self._peers[key] = self.transport.add_peer(doc.agent_metadata, doc.regions)
                log.info("KV peer %s at %s:%d connected", doc.engine_id, *key)
            except Exception as exc:  # handshake I/O, incompatible layout, NIXL refusal
                self.counters["peers_refused"] += 1
                log.warning("KV peer %s:%d refused: %s", key[0], key[1], exc)
                self._fail_plans_for(key, f"KV peer {key[0]}:{key[1]}: {exc}")

    def _fail_plans_for(self, key: tuple[str, int], error: str) -> None:
        for rid, plan in list(self._waiting.items()):
            if (plan.host, plan.port) == key:
                del self._waiting[rid]
                self._failed.append(self._result(plan, error))

    def _start_read(self, agent: str, plan: LoadPlan) -> None:
        remote_units = self.transport.peer_regions(agent)["kv"].num_units
        num_positions = len(plan.local_tables[0]) if plan.local_tables else 0
        valid = num_positions
        for g, (local, remote) in enumerate(zip(plan.local_tables, plan.remote_tables)):
            for k in range(min(valid, len(local))):
                rid = remote[k] if k < len(remote) else None
                if isinstance(rid, bool) or not isinstance(rid, int) \
                        or not 0 <= rid < remote_units:
                    valid = k      # blocks from the first missing one are computed here
                    break
        plan.num_valid_positions = valid
        local_ids, remote_ids = [], []
        for g, (local, remote) in enumerate(zip(plan.local_tables, plan.remote_tables)):
            for k in range(min(valid, len(local))):
                if self.sliding[g] and (remote[k] == 0 or local[k] == 0):
                    continue   # a null block (outside the window) on either side
                local_ids.append(local[k])
                remote_ids.append(remote[k])
        units = {"kv": (local_ids, remote_ids)}
        if plan.state_pair is not None:
            local_slot, remote_slot = plan.state_pair
            units["state"] = ([local_slot], [remote_slot])
            if plan.boundary_snapshot is not None:
                units["state"][0].append(plan.boundary_snapshot[0])
                units["state"][1].append(plan.boundary_snapshot[1])
        try:
            plan.transfer_id = self.transport.start_read(
                agent, units,
                notification=plan.remote_request_id, timeout_s=self.config.kv_load_timeout)
        except Exception as exc:
            self._failed.append(self._result(plan, f"READ refused: {exc}"))
            return
        self._reading[plan.request_id] = plan

    def _result(self, plan: LoadPlan, error: Optional[str], arrived: bool = False) -> LoadResult:
        """`arrived`: the READ completed, so the valid prefix of the blocks is here."""
        loaded = min(plan.num_external, plan.num_valid_positions * self.block_size) \
            if arrived else 0
        wanted = len(plan.local_tables[0]) if plan.local_tables else 0
        if arrived and plan.num_valid_positions < wanted:
            error = f"only {plan.num_valid_positions} of {wanted} remote block ids are valid"
        restart = False
        self._drop_boundary_snapshot(plan, publish=arrived and error is None)
        if plan.state_pair is not None and error is not None:
            # Blocks without the state at their end are useless to a recurrent model.
            loaded, restart = 0, True
        if error is None:
            self.counters["loads_ok"] += 1
        else:
            self.counters["loads_failed"] += 1
            log.warning("KV load for %s: %s; computing locally from prompt token %d",
                        plan.request_id, error, loaded)
        self.counters["tokens_pulled"] += loaded
        return LoadResult(plan.request_id, loaded, error, restart)

    def _drop_boundary_snapshot(self, plan: LoadPlan, publish: bool = False) -> None:
        if plan.boundary_snapshot is None:
            return
        slot, _, block_hash = plan.boundary_snapshot
        plan.boundary_snapshot = None
        if publish and block_hash not in self.kv.snapshots:
            self.kv.snapshots.publish(block_hash, slot)
        self.kv.snapshots.release(slot)

    def _collect_notifications(self) -> None:
        for note in self.transport.notifications():
            lease = self._leases.pop(note.message.decode(errors="replace"), None)
            if lease is not None:
                self._end_lease(lease)
                self.counters["leases_released"] += 1

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for lease_id, lease in list(self._leases.items()):
            if now > lease.deadline:
                del self._leases[lease_id]
                self._end_lease(lease)
                self.counters["leases_expired"] += 1
                log.info("KV blocks held for %s expired unread", lease_id)
