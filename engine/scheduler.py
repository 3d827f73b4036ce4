"""Who runs this step, with how many tokens, and who is preempted.

A pure decision-maker over request state and the KV cache manager: no model, no tensors,
so it can be tested on its own. Continuous batching in the style of vLLM v1: every request
has `num_computed_tokens`; a step gives running requests (decodes and unfinished chunked
prefills) their tokens first, then admits waiting ones, all under one token budget. When
blocks run out, the most recently admitted running request is preempted: its blocks are
freed and it goes back to the head of the waiting line to be recomputed.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from pdpool.engine.kv.block_pool import Block
from pdpool.engine.kv.manager import KVCacheManager, cdiv
from pdpool.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from pdpool.engine.connector.base import KVConnector

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

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class ThresholdDecision:
    threshold: float
    source: str  # "request" or "global"
    ratio: float


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, connector: Optional["KVConnector"] = None
    ):
        from pdpool.engine.connector.base import KVConnector

        self.config = config
        self.kv = kv
        self.connector = connector or KVConnector()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests whose KV is being read from another engine (blocks allocated).
        self.loading: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_threshold_rejections = {"request": 0, "global": 0}

    # --- queue management ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Ends a request wherever it is and returns its blocks to the pool."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif self.loading.pop(request.request_id, None) is not None:
            self.connector.request_aborted(request)
        request.status = status
        self.kv.free(request)

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

    # --- the decision -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """One step's decision: running requests first, then admissions, under one budget."""
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        # Waiting requests, in arrival order; none after a preemption this step.
        while (
            self.waiting
            and budget > 0
            and not out.preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            charged = self._admit(self.waiting[0], out, budget)
            if charged is None:
                break  # the head of the line does not fit: nobody behind it jumps ahead
            budget -= charged
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests, oldest first, preempting the newest when blocks run out.
        Returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            num_new = self._align_chunk(req, req.num_computed_tokens, num_new)
            if num_new <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # req preempted itself: nothing after it can fit either
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
            i += 1
        return budget

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
        # Tokens coming from a remote engine count as cached for the threshold.
        decision = self.threshold_decision(req, num_local + num_external)
        if decision is not None:
            self.waiting.popleft()
            self._reject(req, decision, num_local)
            req.kv_params_out = self.connector.describe_rejected(req, hits, num_local)
            out.rejected.append(req)
            return 0
        if num_external:
            return 0 if self._start_loading(req, hits, num_local, num_external) else None
        return self._start_running(req, hits, num_local, out, budget)

    def _start_loading(
        self, req: Request, hits: list[list[Block]], num_local: int, num_external: int
    ) -> bool:
        """Blocks for the remote tokens now; the READ runs while others compute."""
        if not self.kv.allocate_slots(req, num_external, hits):
            return False
        self.waiting.popleft()
        req.num_computed_tokens = num_local
        if req.num_cached_tokens is None:
            req.num_cached_tokens = num_local  # loaded tokens are added when they arrive
        self.connector.update_state_after_alloc(
            req, self.kv.block_tables(req.request_id), num_local, num_external
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
            charged = budget
        num_new = self._align_chunk(req, num_cached, num_new)
        if num_new <= 0:
            return None
        if (
            not self.config.prefix_aware_admission
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
        """A decision to reject, or None to admit. Prefill legs are never gated."""
        if req.is_prefill_leg:
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

    def _reject(self, req: Request, d: ThresholdDecision, num_cached: int) -> None:
        req.status = RequestStatus.FINISHED_CACHE_THRESHOLD
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
