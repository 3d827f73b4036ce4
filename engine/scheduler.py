"""Who runs this step, with how many tokens, and who is preempted; and the one owner of
every KV block's lifetime.

A pure decision-maker over request state and the KV cache manager: no model, no tensors,
so it can be tested on its own. Continuous batching in the style of vLLM v1: every request
has `num_computed_tokens`; a step gives running requests (decodes and unfinished chunked
prefills) their tokens first, then admits waiting ones, all under one token budget. When
blocks run out, a running request is preempted: its blocks are freed and it goes back to
the waiting line to be recomputed. Which one, and the line's order, follow the scheduling
policy as vLLM 0.32's do: fcfs preempts the most recently admitted and puts it back at the
head; priority preempts the lowest priority (highest value, then latest arrival) and
orders the line by (priority, arrival) (request_queue.py). As in vLLM v1, only a running
request short of blocks preempts: a waiting one, whatever its priority, waits for room.

Only this module calls the KV cache manager (tests/engine/test_kv_owner_contract.py keeps
it so). The runner gets a per-step copy of the block tables (`SchedulerOutput.kv_view`);
the connector is told block ids and state slots at allocation and at finish, answers with
the blocks to keep for a peer (held here under a lease id), and reports when transfers and
leases end (`collect_transfers`); the engine core asks for capacity and usage facts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from pdpool.engine.connector.base import (
    AllocatedKV,
    BlockHold,
    CachedPrefix,
    FinishedKV,
    KVConnector,
    LoadResult,
)
from pdpool.engine.kv.block_pool import Block
from pdpool.engine.kv.facts import KVCacheSpec, KVCacheUsage, KVStepView
from pdpool.engine.kv.manager import KVCacheManager, cdiv
from pdpool.engine.request import Request, RequestStatus
from pdpool.engine.request_queue import priority_key, waiting_queue
from pdpool.engine.stop_check import check_stop

if TYPE_CHECKING:
    from pdpool.engine.connector.offload_tier import KVOffload
    from pdpool.kv_events import KVEventPublisher

log = logging.getLogger("pdpool.scheduler")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    # Prefix-cache-aware admission. Off only to measure what it brings.
    prefix_aware_admission: bool = True
    global_cache_hit_threshold: float = 0.0
    # vLLM's --scheduling-policy: fcfs or priority (request_queue.py).
    policy: str = "fcfs"
    # --max-loras: distinct LoRA adapters among running requests (0: no LoRA).
    max_loras: int = 0


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Finished without running: below their cache-hit threshold.
    rejected: list[Request] = field(default_factory=list)
    # The scheduled requests' blocks and state slots, for the runner.
    kv_view: KVStepView = field(default_factory=KVStepView)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def only(self, item: ScheduledRequest) -> SchedulerOutput:
        """This step for one of its requests alone (to re-run it on its own)."""
        return SchedulerOutput([item], kv_view=self.kv_view.only(item.request.request_id))


@dataclass
class ThresholdDecision:
    threshold: float
    source: str  # "request" or "global"
    ratio: float


NORMAL_FINISH = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        connector: Optional[KVConnector] = None,
        offload: Optional[KVOffload] = None,
    ):
        self.config = config
        self.kv = kv
        self.connector = connector or KVConnector()
        # A KV offload tier below the pool (kv/offload/): blocks are written through to it
        # as they are cached, and a prefix miss it holds is loaded like a remote one.
        self.offload = offload
        self.tier_loading: set[str] = set()
        self._offload_blocks: list[tuple[Request, int, int, Block]] = []
        self._offload_snapshots: list[tuple[int, bytes]] = []
        if offload is not None:
            kv.on_block_cached = lambda req, g, i, b: self._offload_blocks.append((req, g, i, b))
            kv.on_snapshot = lambda slot, h: self._offload_snapshots.append((slot, h))
        self.waiting = waiting_queue(config.policy)
        self.running: list[Request] = []
        # Requests whose KV is being read from another engine (blocks allocated).
        self.loading: dict[str, Request] = {}
        # Aborted requests whose READ was still in flight: their blocks, until it ends.
        self.reading_after_abort: dict[str, list[Block]] = {}
        # Snapshot slots reserved for a load's state at its last block boundary:
        # request id -> (slot, that block's hash), until the load ends.
        self.incoming_snapshots: dict[str, tuple[int, bytes]] = {}
        self.num_preemptions = 0
        self.num_threshold_rejections = {"request": 0, "global": 0}

    @classmethod
    def for_cache(
        cls,
        config: SchedulerConfig,
        spec: KVCacheSpec,
        connector: Optional[KVConnector] = None,
        offload: Optional[KVOffload] = None,
    ) -> Scheduler:
        """A scheduler owning a new KV cache manager of `spec`."""
        return cls(config, KVCacheManager.from_spec(spec), connector, offload)

    # --- facts for the engine core ------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        """The most tokens one request can hold in the KV cache."""
        return self.kv.capacity_tokens

    def kv_usage(self) -> KVCacheUsage:
        return self.kv.usage()

    def publish_kv_events(self, publisher: KVEventPublisher) -> None:
        """Publishes the cache's changes from now on (vLLM's KV-events format)."""
        self.kv.attach_events(publisher)

    def close(self) -> None:
        """Closes the connector; whatever it still held for peers goes back."""
        self.connector.close()
        if self.offload is not None:
            self.offload.close()
        for lease_id in self.kv.lease_holds():
            self.kv.end_lease_hold(lease_id)

    # --- queue management ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self._prefetch_from_tier(request)

    def _prefetch_from_tier(self, req: Request) -> None:
        """A prefix the offload tier holds starts loading into host memory now, while the
        request waits in line for blocks (at its admission only the copy is left)."""
        if self.offload is None or not self.kv.enable_caching:
            return
        first = self.kv.peek_computed_tokens(req) // self.kv.block_size
        num = self._tier_hit(req, first * self.kv.block_size) // self.kv.block_size
        if num:
            self.offload.prefetch(req.request_id, req.block_hashes, first, first + num)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Ends a request wherever it is. The connector answers the response's
        kv_transfer_params and may keep some blocks for a peer; the rest go back to the
        pool, unless a READ still writes into them."""
        if request.is_finished:
            return
        still_reading = False
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif self.loading.pop(request.request_id, None) is not None:
            if request.request_id in self.tier_loading:
                # A tier read lands in host memory first: the blocks may go now.
                self.tier_loading.discard(request.request_id)
            else:
                still_reading = self.connector.request_aborted(request)
        if self.offload is not None:
            self.offload.cancel(request.request_id)  # its read, staged or loading
        request.status = status
        handoff = self.connector.request_finished(
            request, status, self._finished_kv(request, status)
        )
        request.kv_params_out = handoff.params
        if handoff.hold is not None:
            self._hold_for_peer(handoff.hold, self.kv.blocks_of(request, handoff.hold.num_tokens))
        if still_reading:
            self.reading_after_abort[request.request_id] = self.kv.detach(request)
            return
        self.kv.free(request)
        self._settle_incoming_snapshot(request.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def finish_loading(
        self, request: Request, num_loaded_tokens: int, restart: bool = False
    ) -> None:
        """The connector's READ ended: what arrived counts as computed; the rest (from the
        first missing block, or from zero when a recurrent state is missing) is computed
        here. The request keeps its place in line."""
        if self.loading.pop(request.request_id, None) is None:
            return
        if restart:
            request.num_computed_tokens = 0
            request.num_cached_tokens = 0
        request.num_computed_tokens += num_loaded_tokens
        # Usage counts only what really arrived.
        request.num_pulled_tokens += num_loaded_tokens
        request.num_cached_tokens = (request.num_cached_tokens or 0) + num_loaded_tokens
        self.kv.cache_full_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def collect_transfers(self) -> list[LoadResult]:
        """What the connector finished since the last call. The KV side is settled here:
        ended leases and aborted reads give their blocks back, a pulled boundary snapshot
        is published. The loads returned are the engine's to apply (`finish_loading`)."""
        report = self.connector.poll()
        for result in report.loads:
            self._settle_incoming_snapshot(
                result.request_id, publish=result.boundary_snapshot_arrived
            )
        for request_id in report.reads_ended:
            self.kv.release(self.reading_after_abort.pop(request_id, []))
            self._settle_incoming_snapshot(request_id)
        for lease_id in report.leases_ended:
            self.kv.end_lease_hold(lease_id)
        loads = report.loads
        if self.offload is not None:
            tier_loads = self.offload.poll()
            for result in tier_loads:
                self.tier_loading.discard(result.request_id)
            loads = loads + tier_loads
        return loads

    def flush_offload(self) -> None:
        """Hands the blocks and state snapshots cached since the last call to the offload
        tier, which copies them now. Call right after the step (and after its state copies)
        and after applying loads: before any allocation can reuse their memory."""
        if self.offload is None:
            return
        from pdpool.engine.connector.offload_tier import BlockNote

        blocks, self._offload_blocks = self._offload_blocks, []
        bs = self.kv.block_size
        for req, g, i, block in blocks:
            h = req.block_hashes[i]
            # The pool names a block by group + hash; reused since, it names another.
            if block.block_hash != bytes([g]) + h:
                continue
            kind = "sliding_window" if self.kv.groups[g].is_sliding else "full_attention"
            parent = req.block_hashes[i - 1] if i else None
            tokens = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
            self.offload.note_block(
                BlockNote(g, block.block_id, h, parent, tokens, kind, req.request_id)
            )
        snaps, self._offload_snapshots = self._offload_snapshots, []
        for slot, h in snaps:
            if self.kv.snapshots.lookup(h) == slot:  # still this hash's snapshot
                self.offload.note_snapshot(slot, h)
        self.offload.save_pending()

    def update_after_forward(self, out: SchedulerOutput) -> list[tuple[int, int]]:
        """The forward computed what was scheduled: requests advance, the KV manager
        publishes what became full. Returns the state copies the runner must make."""
        copies = []
        for item in out.scheduled:
            req = item.request
            if req.is_finished:  # failed in the forward
                continue
            req.num_computed_tokens += item.num_new_tokens
            copies += self.kv.commit_computed(req)
        return copies

    def append_sampled(self, req: Request, token: int) -> Optional[RequestStatus]:
        """Gives a request its sampled token (its grammar must accept it) and says whether
        that token ends it (stop_check.py: stop tokens, EOS, length). Text stops are the
        output processor's; whoever learns the final status finishes the request."""
        req.append_output_token(token)
        if req.grammar is not None and not req.grammar.accept(token):
            raise RuntimeError(f"the grammar refused the sampled token {token}")
        return check_stop(req, self.config.max_model_len)

    # --- the decision -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """One step's decision: running requests first, then admissions, under one budget."""
        out = SchedulerOutput()
        budget = self._schedule_running(out)
        # Waiting requests in the policy's order; none after a preemption this step.
        # Requests whose adapter cannot join this step (--max-loras distinct adapters run
        # already) step aside, as in vLLM, and keep their place for the next step.
        aside: list[Request] = []
        while (
            self.waiting
            and budget > 0
            and not out.preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            if not self._adapter_fits(self.waiting[0]):
                aside.append(self.waiting.popleft())
                continue
            charged = self._admit(self.waiting[0], out, budget)
            if charged is None:
                # The head of the line does not fit: nobody behind it jumps ahead.
                if not self.running:
                    self._preempt_waiting_holder(out, spare=self.waiting[0])
                break
            budget -= charged
        for req in reversed(aside):
            self.waiting.appendleft(req)
        out.kv_view = self.kv.step_view([s.request.request_id for s in out.scheduled])
        return out

    def running_adapters(self) -> set[str]:
        return {r.lora.name for r in self.running if r.lora is not None}

    def _adapter_fits(self, req: Request) -> bool:
        if req.lora is None or not self.config.max_loras:
            return True
        names = self.running_adapters()
        return req.lora.name in names or len(names) < self.config.max_loras

    def _schedule_running(self, out: SchedulerOutput) -> int:
        """Running requests, oldest first, preempting by the policy when blocks run out.
        Returns the budget left."""
        i = 0
        budget = self.config.max_num_batched_tokens
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            num_new = _prompt_rows_chunk(req, num_new)
            num_new = self._align_chunk(req, req.num_computed_tokens, num_new)
            if num_new <= 0:
                i += 1
                continue
            num_preempted = len(out.preempted)
            given_back = self._make_room(req, num_new, out)
            if given_back is None:
                break  # req preempted itself: nothing after it can fit either
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget += given_back - num_new
            # Victims ahead of it in the list (priority policy) moved it forward.
            i = self.running.index(req) + 1 if len(out.preempted) > num_preempted else i + 1
        return budget

    def _make_room(self, req: Request, num_new: int, out: SchedulerOutput) -> Optional[int]:
        """Allocates `num_new` tokens' slots for running `req`, preempting until they fit.
        Returns the budget that victims scheduled earlier in this step give back (priority
        policy: they are taken back out), or None when `req` itself was preempted."""
        given_back = 0
        while not self.kv.allocate_slots(req, num_new):
            if self._preempt_waiting_holder(out):
                continue
            victim = self._victim()
            for item in out.scheduled:
                if item.request is victim:
                    out.scheduled.remove(item)
                    given_back += item.num_new_tokens
                    break
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return None
        return given_back

    def _victim(self) -> Request:
        """The running request to preempt: fcfs, the most recently admitted; priority, the
        lowest priority (highest value), latest arrival among equals (as vLLM)."""
        if self.config.policy == "priority":
            return max(self.running, key=priority_key)
        return self.running[-1]

    def _admit(self, req: Request, out: SchedulerOutput, budget: int) -> Optional[int]:
        """Decides for the request at the head of the line: reject it (below its cache-hit
        threshold), start loading its KV from a peer, or start running it. Returns the
        budget it takes, or None when it cannot be admitted this step."""
        if self.kv.holds(req):
            # Back from a remote load: it holds its blocks and was judged on admission.
            return self._start_running(req, None, req.num_computed_tokens, out, budget)
        skip_state = self.connector.will_load_state(req)
        hits, num_local = self.kv.get_computed_blocks(req, skip_state)
        num_external = self.connector.get_num_new_matched_tokens(req, num_local)
        if skip_state and not num_external:
            # Nothing will arrive after all: the hit must include the state.
            hits, num_local = self.kv.get_computed_blocks(req)
        num_tier = 0 if num_external else self._tier_hit(req, num_local)
        if not num_tier and self.offload is not None:
            self.offload.cancel(req.request_id)  # a read staged at its arrival is of no use
        # Tokens coming from a remote engine or an offload tier count as cached for the
        # threshold (a decode that can load the prefix need not prefill elsewhere).
        decision = self.threshold_decision(req, num_local + num_external + num_tier)
        if decision is not None:
            self.waiting.popleft()
            self._reject(req, decision, num_local)
            self._describe_rejected(req, hits, num_local)
            out.rejected.append(req)
            return 0
        if num_external:
            return 0 if self._start_loading(req, hits, num_local, num_external) else None
        if num_tier:
            return self._start_tier_load(req, hits, num_local, num_tier, out, budget)
        return self._start_running(req, hits, num_local, out, budget)

    def _tier_hit(self, req: Request, num_local: int) -> int:
        """Tokens past the local hit that the offload tier holds (whole blocks, leaving
        at least one token to compute)."""
        if self.offload is None or not self.kv.enable_caching or req.computes_prompt_rows:
            return 0
        bs = self.kv.block_size
        limit = min((req.num_tokens - 1) // bs, len(req.block_hashes))
        return self.offload.lookup(req.block_hashes, num_local // bs, limit) * bs

    def _start_tier_load(
        self,
        req: Request,
        hits: list[list[Block]],
        num_local: int,
        num_tier: int,
        out: SchedulerOutput,
        budget: int,
    ) -> Optional[int]:
        """Blocks for the tier's tokens now. A read staged while the request waited in
        line is copied at once and the request runs in this step; else the read runs on
        the tier's I/O thread while others compute, and the request waits as it waits on a
        remote load. Returns the budget taken, None when the pool has no room."""
        if not self._allocate_for_load(req, hits, num_local, num_tier):
            return None
        assert self.offload is not None
        bs, rid = self.kv.block_size, req.request_id
        loaded = self.offload.start_load(
            rid,
            req.block_hashes,
            self.kv.block_tables(rid),
            self.kv.state_slot(rid) if self.kv.has_state else None,
            num_local // bs,
            (num_local + num_tier) // bs,
        )
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[rid] = req
        if loaded is None:
            self.tier_loading.add(rid)
            return 0
        self.finish_loading(req, loaded.num_loaded_tokens, loaded.restart)
        return self._admit(req, out, budget)  # holding its blocks: it starts running

    def _allocate_for_load(
        self, req: Request, hits: list[list[Block]], num_local: int, num_loaded: int
    ) -> bool:
        """Takes the request off the line holding blocks for `num_loaded` tokens past
        its local hit; False (nothing changed) when the pool cannot."""
        if not self.kv.allocate_slots(req, num_loaded, hits):
            return False
        self.waiting.popleft()
        if req.phases.admitted is None:
            req.phases.admitted = time.monotonic()
        req.num_computed_tokens = num_local
        if req.num_cached_tokens is None:
            req.num_cached_tokens = num_local  # loaded tokens are added when they arrive
        return True

    def _start_loading(
        self, req: Request, hits: list[list[Block]], num_local: int, num_external: int
    ) -> bool:
        """Blocks for the remote tokens now; the READ runs while others compute."""
        if not self._allocate_for_load(req, hits, num_local, num_external):
            return False
        self.connector.update_state_after_alloc(
            req, self._allocated_for_load(req, num_local + num_external), num_local, num_external
        )
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[req.request_id] = req
        return True

    def _start_running(
        self,
        req: Request,
        hits: Optional[list[list[Block]]],
        num_cached: int,
        out: SchedulerOutput,
        budget: int,
    ) -> Optional[int]:
        num_new = req.num_tokens - num_cached
        # Without awareness (the comparison baseline), cached tokens are charged to the
        # budget and cached blocks are allocated as if they were new.
        charged = num_new if self.config.prefix_aware_admission else req.num_tokens
        if charged > budget:
            if not self.config.enable_chunked_prefill:
                return None
            num_new = budget if self.config.prefix_aware_admission else max(budget - num_cached, 0)
            if num_new == 0 and budget == self.config.max_num_batched_tokens:
                # Cached tokens alone fill a whole step's budget: a token a step still
                # moves it on (else it would wait at the head of the line forever).
                num_new = 1
            charged = budget
        num_new = _prompt_rows_chunk(req, num_new)
        num_new = self._align_chunk(req, num_cached, num_new)
        if num_new <= 0:
            return None
        if (
            not self.config.prefix_aware_admission
            and hits is not None  # not back from a load, holding its blocks already
            and cdiv(req.num_tokens, self.kv.block_size) > self.kv.num_free_blocks
        ):
            return None
        if not self.kv.allocate_slots(req, num_new, hits):
            return None
        self.waiting.popleft()
        if req.num_cached_tokens is None:
            req.num_cached_tokens = num_cached
        if hits is not None:
            self.kv.restore_state(req, num_cached)
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.RUNNING
        _stamp_running(req)
        self.running.append(req)
        out.scheduled.append(ScheduledRequest(req, num_new))
        return charged

    def _align_chunk(self, req: Request, start: int, num_new: int) -> int:
        """For recurrent-state models, a prefill chunk ends on a block boundary when it can,
        so a state snapshot can be taken there (the "align" idea): a chunk that would end
        mid-block stops at the boundary before, and the rest follows in the next step."""
        if not self.kv.has_state or num_new <= 1:
            return num_new
        bs = self.kv.block_size
        end = start + num_new
        aligned = end // bs * bs
        if end % bs and aligned > start:
            return aligned - start
        # A prefill leg also stops one token short of its prompt: the decode engine
        # recomputes the last token, so it needs the state just before it.
        last = req.num_prompt_tokens - 1
        if req.is_prefill_leg and start < last < end:
            return last - start
        return num_new

    def threshold_decision(self, req: Request, num_cached: int) -> Optional[ThresholdDecision]:
        """A decision to reject, or None to admit. Prefill legs are never gated, nor are
        requests for their prompt's logprobs (they compute every prompt row wherever they
        run: another engine's prefill cannot spare that)."""
        if req.is_prefill_leg or req.computes_prompt_rows:
            return None
        if req.cache_hit_threshold is not None:
            threshold, source = req.cache_hit_threshold, "request"
        else:
            threshold, source = self.config.global_cache_hit_threshold, "global"
        if threshold <= 0.0:
            return None
        # A preempted request is judged on everything it must recompute.
        total = req.num_tokens
        ratio = num_cached / total if total else 1.0
        if ratio >= threshold:
            return None
        return ThresholdDecision(threshold, source, ratio)

    # --- transitions --------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _preempt_waiting_holder(
        self, out: SchedulerOutput, spare: Optional[Request] = None
    ) -> bool:
        """Blocks are short while requests in the waiting line hold some (back from a
        remote load): they cannot run before their turn, and running requests (or the head
        of the line, when nothing runs) would wait on them forever. The last of them gives
        its blocks back (what it cached stays cached) and is recomputed; `spare` is the
        request that asks. False when no waiting request holds blocks."""
        for req in reversed(self.waiting):
            if req is not spare and self.kv.holds(req):
                self.kv.free(req)
                req.num_computed_tokens = 0
                req.num_preemptions += 1
                self.num_preemptions += 1
                out.preempted.append(req)
                return True
        return False

    def _reject(self, req: Request, d: ThresholdDecision, num_cached: int) -> None:
        req.status = RequestStatus.FINISHED_CACHE_THRESHOLD
        if self.offload is not None:
            self.offload.cancel(req.request_id)
        if req.num_cached_tokens is None:
            req.num_cached_tokens = num_cached
        self.num_threshold_rejections[d.source] += 1
        log.info(
            "request %s rejected: cache hit ratio %.3f < %s threshold %.3f "
            "(%d of %d tokens cached)",
            req.request_id,
            d.ratio,
            d.source,
            d.threshold,
            num_cached,
            req.num_tokens,
        )

    # --- what the connector is told, and what it asks to keep ---------------------------
    def _allocated_for_load(self, req: Request, end: int) -> AllocatedKV:
        """The blocks (and state slots) that the pulled tokens, up to `end`, go into. A
        recurrent model also gets a snapshot slot for the peer's state at the last block
        boundary, unless that state is cached here already."""
        tables = self.kv.block_tables(req.request_id)
        if not self.kv.has_state:
            return AllocatedKV(tables)
        boundary = end // self.kv.block_size
        snapshot = None
        if boundary and not self.kv.has_snapshot(req.block_hashes[boundary - 1]):
            slot = self.kv.reserve_snapshot_slot()
            if slot is not None:
                snapshot = (slot, req.block_hashes[boundary - 1])
                self.incoming_snapshots[req.request_id] = snapshot
        return AllocatedKV(tables, self.kv.state_slot(req.request_id), snapshot)

    def _settle_incoming_snapshot(self, request_id: str, publish: bool = False) -> None:
        """A load ended: its reserved snapshot slot is published (the state arrived) and
        unpinned either way."""
        reserved = self.incoming_snapshots.pop(request_id, None)
        if reserved is None:
            return
        slot, block_hash = reserved
        if publish:
            self.kv.publish_snapshot(block_hash, slot)
        self.kv.release_snapshot_slot(slot)

    def _finished_kv(self, req: Request, status: RequestStatus) -> FinishedKV:
        handed = req.transfer_state_slot
        boundary_snapshot = None
        if handed is not None and status in NORMAL_FINISH:
            # The snapshot at the last block boundary before the handed-over state.
            boundary = (req.num_prompt_tokens - 1) // self.kv.block_size
            if boundary:
                boundary_snapshot = self.kv.snapshot_at(req.block_hashes[boundary - 1])
        return FinishedKV(self.kv.block_tables(req.request_id), handed, boundary_snapshot)

    def _describe_rejected(self, req: Request, hits: list[list[Block]], num_cached: int) -> None:
        snapshot = None
        if self.kv.has_state and num_cached:
            snapshot = self.kv.snapshot_at(req.block_hashes[num_cached // self.kv.block_size - 1])
        prefix = CachedPrefix(
            [[b.block_id for b in blocks] for blocks in hits], num_cached, snapshot
        )
        handoff = self.connector.describe_rejected(req, prefix)
        req.kv_params_out = handoff.params
        if handoff.hold is not None:
            n = cdiv(handoff.hold.num_tokens, self.kv.block_size)
            self._hold_for_peer(handoff.hold, [blocks[:n] for blocks in hits])

    def _hold_for_peer(self, hold: BlockHold, tables: list[list[Block]]) -> None:
        """Keeps blocks and state slots for a peer until the connector ends the lease."""
        self.kv.hold_for_lease(hold.lease_id, tables, hold.state_slots)


def _stamp_running(req: Request) -> None:
    """The first time a request runs (admitted now, unless it loaded KV first): a
    preempted request keeps its first times."""
    phases = req.phases
    if phases.running is None:
        phases.running = time.monotonic()
        if phases.admitted is None:
            phases.admitted = phases.running


# Prompt rows a step computes the logits of for one request's prompt_logprobs: each costs
# the whole vocabulary's logits, so a long prompt's are spread over steps instead of
# stalling one step (and every stream in it).
PROMPT_LOGPROB_ROWS_PER_STEP = 512


def _prompt_rows_chunk(req: Request, num_new: int) -> int:
    if not req.computes_prompt_rows:
        return num_new
    return min(num_new, PROMPT_LOGPROB_ROWS_PER_STEP)
