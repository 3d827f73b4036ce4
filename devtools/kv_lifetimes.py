"""Block lifetimes under random interleavings: a seeded property test's generator and checks.

Each example builds a real Scheduler over a real KVCacheManager (full attention, a sliding
window, or a recurrent-state model; small pools so that preemption is common) and drives it
through a random sequence of: admissions (shared prefixes, so prefix hits; prefill legs;
requests that pull from a peer; requests under a cache-hit threshold), engine steps
(chunked prefills, decodes, finishes), aborts, peers opening and reading leases, lease
expiry, loads that succeed, arrive in part or fail (some aborted mid-READ), and core
restarts (a fresh scheduler, manager and lease epoch). No model runs: a step's forward is
only "the scheduled tokens are computed, a token is sampled".

The connector is `ScriptedPeer`: the scheduler-facing half of the NIXL connector (the same
real LeaseTable, the same hand-offs) with the network replaced by the example's choices.

After every operation:
- every block's reference count equals the references the scheduler can name (request
  tables, lease holds, blocks kept for an aborted READ), and a block is on the free list
  exactly when nothing references it;
- every live lease is held, on blocks that still hold what they held when it was granted;
- every block a READ may still write into is allocated;
- recurrent-state slots: each running slot is free or owned by one request; snapshot pins
  equal the holds that need them;
- when nothing is in flight, every block is free (cached ones evictable) and no slot held.

The generator and its checks, shared by the suite's bounded run
(tests/engine/test_kv_lifetimes.py) and the long run (benchmarks/kv_lifetimes_fuzz.py);
`run_examples` raises AssertionError naming the seed and the last steps of a failure.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from pdpool.engine.connector.base import (
    AllocatedKV,
    BlockHold,
    CachedPrefix,
    FinishedKV,
    Handoff,
    KVConnector,
    LoadResult,
    TransferReport,
)
from pdpool.engine.kv.facts import KVCacheSpec
from pdpool.engine.kv.groups import KVGroup, SlidingWindowGroup
from pdpool.engine.kv.leases import LeaseRefused, LeaseTable
from pdpool.engine.kv.manager import KVCacheManager
from pdpool.engine.request import Request, RequestStatus
from pdpool.engine.sampling_params import SamplingParams
from pdpool.engine.scheduler import NORMAL_FINISH, Scheduler, SchedulerConfig

SUITE_EXAMPLES = 300
# What the examples exercised, so that a generator drifting into triviality shows.
SEEN: Counter[str] = Counter()
STEPS_PER_EXAMPLE = 120
HOLD_S = 30.0  # lease hold; expiry is simulated by moving the table's clock past it


@dataclass
class ScriptedLoad:
    request: Request
    allocated: AllocatedKV
    num_external: int
    phase: str = "planned"  # planned -> reading; aborted: reading, request gone


class ScriptedPeer(KVConnector):
    """The connector's scheduler side, with peers and the network played by `rng`."""

    name = "scripted"

    def __init__(self, rng: random.Random, block_size: int, has_state: bool) -> None:
        self.rng = rng
        self.block_size = block_size
        self.has_state = has_state
        self.epoch = uuid.uuid4().hex
        self.leases = LeaseTable(self.epoch, hold_s=HOLD_S, max_read_s=5.0)
        self.clock_offset = 0.0
        self.loads: dict[str, ScriptedLoad] = {}
        self.remote_tokens: dict[str, int] = {}  # pull requests: tokens the peer leases
        self.granted: dict[str, list[list[int]]] = {}  # lease id -> block ids

    def now(self) -> float:
        return time.monotonic() + self.clock_offset

    # --- scheduler side -----------------------------------------------------------------
    def will_load_state(self, request: Request) -> bool:
        return self.has_state and request.request_id in self.remote_tokens

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> int:
        remote = self.remote_tokens.get(request.request_id)
        if remote is None or request.kv_consumed:
            return 0
        gain = min(remote, request.num_tokens - 1) - num_local_computed
        if gain <= 0:
            request.kv_consumed = True
            return 0
        return gain

    def update_state_after_alloc(
        self, request: Request, allocated: AllocatedKV, num_local: int, num_external: int
    ) -> None:
        request.kv_consumed = True  # never pull twice, as the NIXL connector
        assert (allocated.state_slot is not None) == self.has_state
        self.loads[request.request_id] = ScriptedLoad(request, allocated, num_external)

    def request_finished(
        self, request: Request, status: RequestStatus, finished: FinishedKV
    ) -> Handoff:
        if status not in NORMAL_FINISH or not request.is_prefill_leg:
            return Handoff()
        n = request.num_prompt_tokens
        slots: tuple[int, ...] = ()
        if finished.transfer_state_slot is not None:
            slots = (finished.transfer_state_slot,)
            if finished.boundary_snapshot_slot is not None:
                slots += (finished.boundary_snapshot_slot,)
        ids = [list(t[: -(-n // self.block_size)]) for t in finished.block_tables]
        return self._lease(request, ids, n, slots)

    def describe_rejected(self, request: Request, prefix: CachedPrefix) -> Handoff:
        if not prefix.num_tokens or (self.has_state and prefix.snapshot_slot is None):
            return Handoff()
        slots = (prefix.snapshot_slot,) if prefix.snapshot_slot is not None else ()
        return self._lease(request, prefix.block_tables, prefix.num_tokens, slots)

    def _lease(
        self, request: Request, ids: list[list[int]], n: int, slots: tuple[int, ...]
    ) -> Handoff:
        lease = self.leases.grant_new(
            uuid.uuid4().hex, request, ids, n, self.block_size, slots, n - 1
        )
        self.granted[lease.lease_id] = ids
        SEEN["lease granted, state slots pinned" if slots else "lease granted"] += 1
        return Handoff({"lease": lease.lease_id}, BlockHold(lease.lease_id, n, slots))

    def request_aborted(self, request: Request) -> bool:
        load = self.loads.get(request.request_id)
        if load is None:
            return False
        if load.phase == "planned":
            del self.loads[request.request_id]
            return False
        load.phase = "aborted"
        return True

    # --- worker side --------------------------------------------------------------------
    def start_loads(self) -> None:
        for load in self.loads.values():
            if load.phase == "planned":
                load.phase = "reading"

    def poll(self) -> TransferReport:
        report = TransferReport()
        for rid, load in list(self.loads.items()):
            if load.phase == "planned" or self.rng.random() < 0.4:
                continue
            del self.loads[rid]
            if load.phase == "aborted":
                SEEN["read ended after abort"] += 1
                report.reads_ended.append(rid)
            else:
                report.loads.append(self._outcome(load))
        expired_before = self.leases.counters["leases_expired"]
        report.leases_ended = [x.lease_id for x in self.leases.take_ended(self.now())]
        SEEN["lease expired"] += self.leases.counters["leases_expired"] - expired_before
        return report

    def _outcome(self, load: ScriptedLoad) -> LoadResult:
        rid, n = load.request.request_id, load.num_external
        kind = self.rng.choice(["ok", "ok", "partial", "failed"])
        SEEN[f"load {kind}"] += 1
        if kind == "ok":
            arrived = load.allocated.boundary_snapshot is not None and self.rng.random() < 0.7
            SEEN["boundary snapshot arrived"] += arrived
            return LoadResult(rid, n, None, False, arrived)
        if self.has_state:  # a state that did not arrive cannot resume mid-prompt
            return LoadResult(rid, 0, f"{kind} load", True)
        loaded = self.rng.randrange(0, max(n // self.block_size, 1)) * self.block_size
        return LoadResult(rid, min(loaded, n), f"{kind} load")

    def close(self) -> None:
        self.leases.take_all()  # as the NIXL connector: an ending engine serves no lease

    def abandon_reads(self) -> None:
        """The core is going away: whatever it was reading ends now."""
        for load in self.loads.values():
            load.phase = "aborted"


class Example:
    """One random engine life: its own pool shape, budgets and operation mix."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = rng = random.Random(seed)
        self.bs = 4
        self.kind = rng.choice(["full", "sliding", "state"])
        self.fail_policy = rng.random() < 0.3
        self.prefixes = [
            [rng.randrange(1, 50) for _ in range(rng.randint(0, 4) * self.bs)] for _ in range(3)
        ]
        self.trace: list[str] = []
        self.next_id = 0
        self.requests: dict[str, Request] = {}
        self._start_core()

    def _start_core(self) -> None:
        rng = self.rng
        max_seqs = rng.randint(2, 6)
        groups: tuple[KVGroup, ...] = (KVGroup(1),)
        if self.kind == "sliding":
            groups = (KVGroup(1), SlidingWindowGroup(1, rng.choice([4, 6, 8])))
        caching = rng.random() < 0.9
        self.spec = KVCacheSpec(
            num_blocks=rng.randint(10, 40),
            block_size=self.bs,
            enable_caching=caching,
            num_state_slots=max_seqs if self.kind == "state" else 0,
            groups=groups,
            num_snapshot_slots=rng.randint(1, 5) if self.kind == "state" and caching else 0,
        )
        self.peer = ScriptedPeer(rng, self.bs, self.kind == "state")
        config = SchedulerConfig(
            max_num_batched_tokens=rng.choice([4, 8, 13, 32]),
            max_num_seqs=max_seqs,
            enable_chunked_prefill=rng.random() < 0.9,
            prefix_aware_admission=rng.random() < 0.9,
        )
        self.sched = Scheduler.for_cache(config, self.spec, self.peer)
        if not config.enable_chunked_prefill:  # as EngineConfig.validate demands
            config.max_num_batched_tokens = max(
                config.max_num_batched_tokens, self.sched.kv_capacity_tokens
            )
        self.kv: KVCacheManager = self.sched.kv
        # lease id -> the hashes of its blocks when granted (what a peer will read)
        self.lease_content: dict[str, list[Optional[bytes]]] = {}

    # --- operations ---------------------------------------------------------------------
    def admit(self) -> None:
        rng, bs = self.rng, self.bs
        max_tokens = rng.randint(1, 6)
        room = self.sched.kv_capacity_tokens - max_tokens
        prompt = rng.choice(self.prefixes) + [
            rng.randrange(1, 50) for _ in range(rng.randint(1, 14))
        ]
        prompt = prompt[: max(room, 1)]
        if room < 1:
            return
        flavor = rng.choice(["plain", "plain", "plain", "prefill_leg", "pull", "threshold"])
        params, threshold = None, None
        if flavor == "prefill_leg":
            params, max_tokens = {"do_remote_decode": True}, 1
        elif flavor == "pull":
            params = {"do_remote_prefill": True}
        elif flavor == "threshold":
            threshold = rng.choice([0.3, 0.6, 0.99])
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = Request(
            rid,
            prompt,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            block_size=bs,
            cache_hit_threshold=threshold,
            kv_transfer_params=params,
        )
        if flavor == "pull":
            self.peer.remote_tokens[rid] = max(len(prompt) - rng.randint(0, bs), 1)
        self.requests[rid] = req
        self.sched.add_request(req)
        self.trace.append(f"admit {rid} {flavor} len={len(prompt)} max={max_tokens}")

    def step(self) -> None:
        sched = self.sched
        for result in sched.collect_transfers():
            req = self.requests.get(result.request_id)
            if req is None or req.is_finished:
                continue
            if result.error and self.fail_policy:
                sched.finish_request(req, RequestStatus.FINISHED_ERROR)
            else:
                sched.finish_loading(req, result.num_loaded_tokens, result.restart)
        hits_before = self.kv.pool.hits
        out = sched.schedule()
        SEEN["prefix hit"] += self.kv.pool.hits > hits_before
        self.peer.start_loads()
        self._check_step_view(out)
        sched.update_after_forward(out)
        for item in out.scheduled:
            req = item.request
            if req.is_finished or req.num_computed_tokens != req.num_tokens:
                continue
            req.append_output_token(self.rng.randrange(1, 50))
            if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                status = self.rng.choice(NORMAL_FINISH)
                sched.finish_request(req, status)
        SEEN["preemption"] += len(out.preempted)
        SEEN["rejection"] += len(out.rejected)
        SEEN["chunked prefill"] += sum(
            1 for x in out.scheduled if x.request.num_computed_tokens < x.request.num_prompt_tokens
        )
        self.trace.append(
            f"step scheduled={[(s.request.request_id, s.num_new_tokens) for s in out.scheduled]}"
            f" preempted={[r.request_id for r in out.preempted]}"
            f" rejected={[r.request_id for r in out.rejected]}"
        )

    def abort(self) -> None:
        live = [r for r in self.requests.values() if not r.is_finished]
        if live:
            req = self.rng.choice(live)
            SEEN[f"abort while {req.status.value}"] += 1
            self.sched.finish_request(req, RequestStatus.FINISHED_ABORTED)
            self.trace.append(f"abort {req.request_id}")

    def peer_open(self) -> None:
        ids = list(self.peer.granted)
        if ids:
            lease_id = self.rng.choice(ids)
            try:
                self.peer.leases.open(lease_id, self.peer.epoch, read_timeout_s=1.0)
                SEEN["peer opened a lease"] += 1
                self.trace.append(f"peer opens {lease_id[:6]}")
            except LeaseRefused as exc:
                self.trace.append(f"peer open refused: {exc}")

    def peer_done(self) -> None:
        """A peer's READ ended (its notification) or it gives an unread lease back."""
        ids = list(self.peer.granted)
        if ids:
            lease_id = self.rng.choice(ids)
            self.peer.leases.release(lease_id)
            self.trace.append(f"peer releases {lease_id[:6]}")

    def expire(self) -> None:
        self.peer.clock_offset += HOLD_S + 10.0
        self.trace.append("clock moves past every hold")

    def restart(self) -> None:
        """The core dies and a fresh one starts: the old one must have leaked nothing once
        it is shut down, and its leases mean nothing to the new one."""
        old_epoch, old_leases = self.peer.epoch, list(self.peer.granted)
        self.shut_down()
        SEEN["core restart"] += 1
        self.trace.append("core restart")
        self.requests.clear()
        self._start_core()
        for lease_id in old_leases[:1]:
            try:
                self.peer.leases.open(lease_id, old_epoch, 1.0)
            except LeaseRefused as refused:
                assert "epoch" in str(refused), refused
            else:
                raise AssertionError(f"lease {lease_id} of the old epoch still opens")

    def shut_down(self) -> None:
        for req in list(self.requests.values()):
            self.sched.finish_request(req, RequestStatus.FINISHED_ABORTED)
        self.sched.close()
        self.peer.abandon_reads()
        self.peer.rng = random.Random(0)
        while self.peer.loads:
            self.sched.collect_transfers()
        self.check()
        self.check_quiescent()

    def drain(self) -> None:
        """No new work: everything in flight ends on its own (leases by expiring), then
        nothing may be held."""
        self.expire()
        for _ in range(2000):
            if not self.sched.has_work() and not self.peer.loads:
                break
            self.step()
            self.check()
        else:
            sched = self.sched
            raise AssertionError(
                f"the engine did not drain in 2000 steps: waiting {list(sched.waiting)}, "
                f"running {sched.running}, loading {list(sched.loading)}, "
                f"{self.kv.pool.num_free_blocks} blocks free, holds {len(self.kv._lease_holds)}"
            )
        for lease_id in list(self.peer.granted):
            self.peer.leases.release(lease_id)
        self.sched.collect_transfers()
        self.check()
        self.check_quiescent()

    # --- invariants ---------------------------------------------------------------------
    def _check_step_view(self, out) -> None:
        view = out.kv_view
        for item in out.scheduled:
            rid = item.request.request_id
            assert view.block_tables[rid] == self.kv.block_tables(rid)
            for table in view.block_tables[rid]:
                for block_id in table:
                    block = self.kv.pool.blocks[block_id]
                    assert block is self.kv.pool.null_block or block.ref_cnt > 0, rid

    def _live_leases(self) -> list[str]:
        now = self.peer.now()
        table = self.peer.leases
        with table._lock:
            live = [x.lease_id for x in table._leases.values() if x.live(now)]
        return live

    def check(self) -> None:
        self._check_reference_counts()
        self._check_leases()
        self._check_reads()
        self._check_state_slots()

    def _check_reference_counts(self) -> None:
        kv, pool, sched = self.kv, self.kv.pool, self.sched
        null = pool.null_block
        expected: Counter[int] = Counter()
        for tables in kv.req_blocks.values():
            expected.update(b.block_id for blocks in tables for b in blocks if b is not null)
        for blocks, _ in kv._lease_holds.values():
            expected.update(b.block_id for b in blocks if b is not null)
        for blocks in sched.reading_after_abort.values():
            expected.update(b.block_id for b in blocks if b is not null)
        for block in pool.blocks:
            if block is null:
                continue
            free = block.block_id in pool._free
            assert block.ref_cnt == expected[block.block_id], (block, expected[block.block_id])
            assert free == (block.ref_cnt == 0), f"{block} free={free}"

    def _check_leases(self) -> None:
        """Every live lease is held, on blocks still holding what they held."""
        kv, null = self.kv, self.kv.pool.null_block
        for lease_id in self._live_leases():
            assert lease_id in kv._lease_holds, f"live lease {lease_id[:6]} not held"
        for lease_id, (blocks, _) in kv._lease_holds.items():
            ids = self.peer.granted.get(lease_id)
            assert ids is not None, f"a hold for lease {lease_id[:6]} nobody granted"
            granted = sorted(i for t in ids for i in t if null is None or i != null.block_id)
            assert granted == sorted(b.block_id for b in blocks if b is not null)
            content = [b.block_hash for b in blocks]
            was = self.lease_content.setdefault(lease_id, content)
            assert all(w is None or w == c for w, c in zip(was, content, strict=True)), lease_id
        for lease_id in list(self.lease_content):
            if lease_id not in kv._lease_holds:
                del self.lease_content[lease_id]
                self.peer.granted.pop(lease_id, None)

    def _check_reads(self) -> None:
        """A READ in flight writes into allocated blocks only."""
        pool, null = self.kv.pool, self.kv.pool.null_block
        for rid, load in self.peer.loads.items():
            if load.phase == "planned":
                continue
            for table in load.allocated.block_tables:
                for block_id in table:
                    block = pool.blocks[block_id]
                    assert block is null or block.ref_cnt > 0, f"{rid} reads into {block}"
            if load.phase == "aborted":
                assert rid in self.sched.reading_after_abort

    def _check_state_slots(self) -> None:
        kv, sched = self.kv, self.sched
        if not kv.has_state:
            return
        running = list(kv.req_slot.values())
        assert len(set(running)) == len(running)
        assert not set(running) & set(kv._free_slots)
        assert sorted(running + kv._free_slots) == list(range(kv.num_state_slots))
        assert set(kv.req_slot) == set(kv.req_blocks)
        pins: Counter[int] = Counter()
        for _, slots in kv._lease_holds.values():
            pins.update(slots)
        pins.update(slot for slot, _ in sched.incoming_snapshots.values())
        pins.update(
            r.transfer_state_slot
            for r in self.requests.values()
            if r.transfer_state_slot is not None
        )
        snaps = kv.snapshots
        assert +snaps.pinned == +pins, (dict(snaps.pinned), dict(pins))
        published = set(snaps._by_hash.values())
        assert not set(snaps._free) & (published | set(snaps.pinned))
        assert len(set(snaps._free)) == len(snaps._free)
        first = kv.num_state_slots
        every = set(range(first, first + self.spec.num_snapshot_slots))
        assert set(snaps._free) | published | set(snaps.pinned) == every

    def check_quiescent(self) -> None:
        kv, sched = self.kv, self.sched
        assert not sched.has_work() and not sched.reading_after_abort
        assert not sched.incoming_snapshots and not kv._lease_holds
        assert not kv.req_blocks and not kv.req_slot
        assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks, "blocks leaked"
        if kv.has_state:
            assert not kv.snapshots.pinned, "state slots leaked"

    def run(self, num_ops: int) -> None:
        ops = [
            (self.admit, 6),
            (self.step, 10),
            (self.abort, 1),
            (self.peer_open, 2),
            (self.peer_done, 2),
            (self.expire, 1),
            (self.restart, 0.3),
        ]
        funcs, weights = zip(*ops, strict=True)
        for _ in range(num_ops):
            self.rng.choices(funcs, weights)[0]()
            self.check()
            if not self.sched.has_work() and not self.peer.loads and not self.kv._lease_holds:
                self.check_quiescent()
        self.drain()


def run_examples(first_seed: int, count: int) -> None:
    for seed in range(first_seed, first_seed + count):
        example = Example(seed)
        try:
            example.run(STEPS_PER_EXAMPLE)
        except AssertionError as exc:
            last = "\n  ".join(example.trace[-25:])
            raise AssertionError(
                f"seed {seed} ({example.kind}, spec {example.spec}): {exc}\n  {last}"
            ) from exc


# Every kind of event an example can produce: a run that never saw one has not tested it.
EVENTS = {
    "preemption", "rejection", "chunked prefill", "lease granted",
    "lease granted, state slots pinned", "peer opened a lease", "lease expired",
    "load ok", "load partial", "load failed", "boundary snapshot arrived",
    "read ended after abort", "abort while running", "abort while waiting_for_remote_kvs",
    "core restart", "prefix hit",
}  # fmt: skip
