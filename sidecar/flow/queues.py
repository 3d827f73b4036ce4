"""Flow control: per-tenant queues inside priority bands, released as the pool frees up.

While the pool has room (saturation.py) and nothing waits, a request is admitted at once
(one comparison on the hot path). Otherwise it waits in its tenant's queue in its band and
is released when capacity frees:
- strict priority between bands: a higher band's request always goes first (a lower band
  is served only while every higher one is empty, or its tenants are at maxConcurrency);
- weighted fair shares within a band: the tenant with the least virtual time goes next
  (then the fewest admitted per weight, then the oldest request). Virtual time is served
  tokens per unit of weight, measured as streaming slot-seconds (first token to end; a
  batch gives each stream a token a step): each admission is charged its expected
  streaming time at once, corrected by the real one at its end (start-time fair queueing
  with a predicted cost), so admissions at one instant interleave by weight and over time
  tenants hold the pool in proportion to their weights. A tenant that was idle starts
  level with the least settled virtual time of the active ones (without their in-flight
  charges): no credit saved while idle, no debt kept. At the pending view's bound (FULL,
  not HARD) that next tenant is admitted without waiting for a release while it is below
  its weighted share of the bound (at least one request), so a quiet tenant does not wait
  for a flood's requests to end;
- the starting bound: at most `starting_bound` admitted requests without their first byte
  at once (past it, only a tenant below its share with none of its own starting adds
  one), so a burst reaches the engines in fair-ordered waves and a newcomer's prefill
  waits behind one wave, not the whole burst;
- per-tenant limits: maxConcurrency (a tenant at it waits), maxQueued, queueTimeoutSeconds,
  tokensPerMinute (prompt + max_tokens estimate, charged at arrival, corrected by the
  usage when the front-end knows it);
- shedding: a request that cannot wait (its tenant's queue full, its wait past its TTL, its
  tenant over its tokens per minute, or the pool's queues full) raises `Shed` (the
  front-end answers 429 with Retry-After); when all queues together are full, the newest
  request of the lowest band below the newcomer's is shed to make room, else the newcomer;
- a request whose client left (its task cancelled) leaves its queue at once.
No HTTP here: the gateway and the endpoint picker both call `FlowControl.admit` (admission.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from .metrics import FlowMetrics
from .saturation import FULL, HARD, ROOM
from .tenants import PoolLimits, Tenant, TenantsConfig

WINDOW_S = 60.0  # tokensPerMinute's window
EXPECTED_SMOOTHING = 0.2  # of the expected streaming time per request
MAX_RETRY_AFTER_S = 60


class SaturationView(Protocol):
    def level(self, admitted: int, limits: PoolLimits) -> int: ...

    def bound(self, limits: PoolLimits) -> int: ...

    def starting_bound(self, limits: PoolLimits) -> int: ...


class Shed(Exception):
    """The request cannot be served now: 429, retry after `retry_after_s`."""

    def __init__(self, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message
        self.retry_after_s = max(1, min(MAX_RETRY_AFTER_S, math.ceil(retry_after_s)))


@dataclass(frozen=True)
class FlowRequest:
    tenant: Tenant
    priority: int
    tokens: int  # estimate: prompt + max_tokens


@dataclass(eq=False)
class _Entry:
    request: FlowRequest
    arrived: float
    future: asyncio.Future[None]
    charge: Optional[list[float]]  # [time, tokens] in the tenant's window
    starting: bool = False  # admitted, no first byte yet
    first_at: Optional[float] = None  # when its first byte came
    charged: float = 0.0  # the virtual time charged at its admission (expected / weight)


@dataclass
class _TenantState:
    in_flight: int = 0
    starting: int = 0  # of in_flight, those without their first token yet
    queued: int = 0
    weight: float = 1.0  # the tenant's, as its latest request saw it
    window: deque[list[float]] = field(default_factory=deque)
    # Its virtual time: streaming slot-seconds (first token to end) per unit of weight.
    # Every streaming request of a batch gets a token a step, so this measures its served
    # tokens. Each admission is charged its expected streaming time at once (so a burst of
    # admissions at one instant interleaves by weight), corrected by the real one at its end.
    service: float = 0.0
    ahead: float = 0.0  # of `service`, the expected charges of requests still in flight
    expected_s: Optional[float] = None  # EWMA of its requests' streaming time

    @property
    def active(self) -> bool:
        return bool(self.in_flight or self.queued)

    def served(self) -> float:
        return self.service

    def settled(self) -> float:
        """Its virtual time without the charges of requests still in flight: where a
        tenant that arrives now starts (level with what the others were really served)."""
        return self.service - self.ahead


class Slot:
    """An admitted request's hold on the pool; `release` once it is over."""

    def __init__(self, flow: FlowController, entry: _Entry) -> None:
        self._flow, self._entry, self._released = flow, entry, False

    def started(self) -> None:
        """The first byte of its answer reached the front-end (its first token, for a
        stream): it no longer counts against the pool's starting bound."""
        if not self._released:
            self._flow._started(self._entry)

    @property
    def counts_tokens(self) -> bool:
        """Whether the tenant has a tokens-per-minute budget (the usage is worth reading)."""
        return self._entry.charge is not None

    def record_usage(self, used_tokens: int) -> None:
        """The request's real usage replaces its estimate in the tenant's window."""
        if self._entry.charge is not None:
            self._entry.charge[1] = float(used_tokens)

    def release(self, used_tokens: Optional[int] = None) -> None:
        if not self._released:
            self._released = True
            self._flow._release(self._entry, used_tokens)


def estimate_tokens(body: Any, default_max_tokens: int = 16) -> int:
    """Prompt + output tokens a generation request may cost, before tokenizing: 4
    characters a token for text, the length of token-id lists, max_tokens for the output
    (the token route's ids and sampling_params.max_tokens alike)."""
    if not isinstance(body, dict):
        return 0
    prompt = body.get("prompt")
    chars, ids = 0, 0
    if isinstance(prompt, str):
        chars = len(prompt)
    elif isinstance(prompt, list):
        for p in prompt:
            chars += len(p) if isinstance(p, str) else 0
            ids += len(p) if isinstance(p, list) else int(isinstance(p, int))
    messages = body.get("messages")  # a completion's body may carry anything under it
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        chars += len(content) if isinstance(content, str) else len(str(content or ""))
        ids += 4  # the template's tokens around each message
    if isinstance(body.get("token_ids"), list):
        ids += len(body["token_ids"])
    return ids + math.ceil(chars / 4) + _output_tokens(body, default_max_tokens)


def _output_tokens(body: dict[str, Any], default_max_tokens: int) -> int:
    params = body.get("sampling_params")
    limits = params if isinstance(params, dict) else body
    out = limits.get("max_tokens") or limits.get("max_completion_tokens")
    return out if isinstance(out, int) and not isinstance(out, bool) else default_max_tokens


class FlowController:
    def __init__(
        self,
        config: Callable[[], TenantsConfig],
        saturation: SaturationView,
        metrics: Optional[FlowMetrics] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.saturation, self.clock = config, saturation, clock
        self.metrics = metrics or FlowMetrics()
        self.admitted = 0  # requests holding a slot
        self.starting = 0  # of them, those without their first byte yet
        self.queued = 0
        self._bands: dict[int, dict[str, deque[_Entry]]] = {}
        self._tenants: dict[str, _TenantState] = {}
        # A first request's expected streaming time (any positive start works: until one
        # has ended, admissions are only interleaved by weight), then the pool's EWMA.
        self._expected_s = 1.0
        self._release_gap_s = 0.5  # EWMA of the time between releases, for Retry-After
        self._last_release: Optional[float] = None

    def state(self, name: str) -> _TenantState:
        st = self._tenants.get(name)
        if st is None:
            st = self._tenants[name] = _TenantState()
        return st

    # ------------------------------------------------------------------ admission
    async def acquire(self, request: FlowRequest) -> Slot:
        """A slot for `request`, once the pool has room for it; Shed when it cannot wait.
        Cancelling the caller (the client left) takes the request out of its queue."""
        cfg = self.config()
        now = self.clock()
        entry = _Entry(request, now, asyncio.get_running_loop().create_future(), None)
        entry.charge = self._charge(request, now)
        self._activate(request.tenant, now)
        if (
            not self.queued
            and self._may_start(request.tenant)
            and self._may_begin(request.tenant, cfg.pool)
            and self.saturation.level(self.admitted, cfg.pool) == ROOM
        ):
            self._grant(entry, now)
            return Slot(self, entry)
        self._enqueue(entry, cfg.pool)
        self.dispatch()
        return await self._wait(entry)

    def _activate(self, tenant: Tenant, now: float) -> None:
        """A tenant with nothing admitted or queued starts level with the least served of
        the active ones (its idle time is neither credit nor debt)."""
        st = self.state(tenant.name)
        if st.active:
            return
        others = [o.settled() for o in self._tenants.values() if o.active]
        st.service, st.ahead = min(others, default=st.service), 0.0
        st.weight = tenant.weight

    def _may_start(self, tenant: Tenant) -> bool:
        return (
            not tenant.max_concurrency or self.state(tenant.name).in_flight < tenant.max_concurrency
        )

    def _may_begin(self, tenant: Tenant, pool: PoolLimits) -> bool:
        """The starting bound: while the pool has that many requests waiting for their first
        token, only a tenant below its weighted share with none of its own starting may add
        one. A burst then reaches the engines in waves, each as the last one's first tokens
        come, so a newcomer's prefill waits behind one wave, not behind the whole burst, and
        each wave is picked by the fair order below (the first arrivals do not fill the
        pool)."""
        gate = self.saturation.starting_bound(pool)
        if not gate or self.starting < gate:
            return True
        return not self.state(tenant.name).starting and self._below_share(tenant, pool)

    def _charge(self, request: FlowRequest, now: float) -> Optional[list[float]]:
        """Tokens per minute: the estimate counted now, or Shed with when it would fit."""
        limit = request.tenant.tokens_per_minute
        if not limit:
            return None
        st = self.state(request.tenant.name)
        while st.window and now - st.window[0][0] >= WINDOW_S:
            st.window.popleft()
        used = sum(c[1] for c in st.window)
        if request.tokens > limit:
            self._shed_count(request, "tokens_per_minute")
            raise Shed(
                "tokens_per_minute",
                f"the request (~{request.tokens} tokens) exceeds tenant "
                f"{request.tenant.name!r}'s {limit} tokens per minute",
                WINDOW_S,
            )
        if used + request.tokens > limit:
            freed, wait = used + request.tokens - limit, WINDOW_S
            for at, tokens in st.window:  # the oldest charges leave the window first
                freed -= tokens
                if freed <= 0:
                    wait = at + WINDOW_S - now
                    break
            self._shed_count(request, "tokens_per_minute")
            raise Shed(
                "tokens_per_minute",
                f"tenant {request.tenant.name!r} is over its {limit} tokens per minute",
                wait,
            )
        charge = [now, float(request.tokens)]
        st.window.append(charge)
        return charge

    def _enqueue(self, entry: _Entry, pool: PoolLimits) -> None:
        request = entry.request
        tenant, st = request.tenant, self.state(request.tenant.name)
        if st.queued >= tenant.max_queued:
            self._refuse(
                entry,
                "queue_full",
                f"tenant {tenant.name!r} has {st.queued} requests queued (its maxQueued)",
            )
        if self.queued >= pool.max_queued and not self._displace_below(request.priority):
            self._refuse(entry, "queue_full", f"the pool's queues are full ({self.queued})")
        queue = self._bands.setdefault(request.priority, {}).setdefault(tenant.name, deque())
        queue.append(entry)
        st.queued += 1
        st.weight = tenant.weight
        self.queued += 1
        self.metrics.queue_length(tenant.name, str(request.priority)).inc()

    def _refuse(self, entry: _Entry, reason: str, message: str) -> None:
        self._refund(entry)
        self._shed_count(entry.request, reason)
        raise Shed(reason, message, self._retry_after(entry.request.priority))

    def _displace_below(self, priority: int) -> bool:
        """Sheds the newest request of the lowest band below `priority` (its most served
        tenant's); False when no band is lower."""
        lower = sorted(
            b for b, tenants in self._bands.items() if b < priority and any(tenants.values())
        )
        if not lower:
            return False
        tenants = self._bands[lower[0]]
        name = max(
            (n for n, q in tenants.items() if q),
            key=lambda n: self.state(n).in_flight / self._weight(tenants[n]),
        )
        victim = tenants[name].pop()
        self._dequeued(victim)
        self._refund(victim)
        self._shed_count(victim.request, "displaced")
        victim.future.set_exception(
            Shed(
                "displaced",
                "shed for higher-priority requests (queues full)",
                self._retry_after(lower[0]),
            )
        )
        return True

    @staticmethod
    def _weight(queue: deque[_Entry]) -> float:
        return queue[0].request.tenant.weight

    # ------------------------------------------------------------------ release
    def dispatch(self) -> None:
        """Admits queued requests while the pool has room: highest band first, the least
        served tenant (per weight) within it."""
        pool = self.config().pool
        while self.queued:
            level = self.saturation.level(self.admitted, pool)
            if level == HARD:
                return
            entry = self._pick(pool)
            if entry is None:
                return  # every waiting tenant is at its maxConcurrency or starting bound
            if level == FULL and not self._below_share(entry.request.tenant, pool):
                return
            entry = self._bands[entry.request.priority][entry.request.tenant.name].popleft()
            self._dequeued(entry)
            self._grant(entry, self.clock())
            entry.future.set_result(None)

    def _pick(self, pool: PoolLimits) -> Optional[_Entry]:
        for band in sorted(self._bands, reverse=True):
            best: Optional[tuple[float, float, float, deque[_Entry]]] = None
            for name, queue in self._bands[band].items():
                tenant = queue[0].request.tenant if queue else None
                if tenant is None or not self._may_start(tenant):
                    continue
                if not self._may_begin(tenant, pool):
                    continue
                st = self.state(name)
                key = (st.served(), st.in_flight / self._weight(queue), queue[0].arrived, queue)
                if best is None or key[:3] < best[:3]:
                    best = key
            if best is not None:
                return best[3][0]
        return None

    def _below_share(self, tenant: Tenant, pool: PoolLimits) -> bool:
        """Whether `tenant` holds less than its weighted share of the pending view's bound,
        among the tenants with requests admitted or waiting (every one may hold one)."""
        in_flight = self.state(tenant.name).in_flight
        if in_flight == 0:
            return True
        active = {n: s.weight for n, s in self._tenants.items() if s.in_flight or s.queued}
        active[tenant.name] = tenant.weight
        return in_flight < self.saturation.bound(pool) * tenant.weight / sum(active.values())

    def _dequeued(self, entry: _Entry) -> None:
        """Bookkeeping for an entry just taken out of its deque."""
        request = entry.request
        self.state(request.tenant.name).queued -= 1
        self.queued -= 1
        self.metrics.queue_length(request.tenant.name, str(request.priority)).dec()
        band = self._bands.get(request.priority, {})
        if not band.get(request.tenant.name):
            band.pop(request.tenant.name, None)
            if not band:
                self._bands.pop(request.priority, None)

    def _grant(self, entry: _Entry, now: float) -> None:
        request = entry.request
        self.admitted += 1
        st = self.state(request.tenant.name)
        st.weight = request.tenant.weight
        expected = self._expected_s if st.expected_s is None else st.expected_s
        entry.charged = expected / st.weight
        st.service += entry.charged
        st.ahead += entry.charged
        st.in_flight += 1
        st.starting += 1
        self.starting += 1
        entry.starting = True
        band = str(request.priority)
        self.metrics.admitted(request.tenant.name, band).inc()
        self.metrics.wait_seconds(request.tenant.name, band).observe(now - entry.arrived)
        self.metrics.in_flight(request.tenant.name).inc()

    def _started(self, entry: _Entry) -> None:
        if not entry.starting:
            return
        entry.first_at = self.clock()
        self._not_starting(entry, self.state(entry.request.tenant.name))
        self.dispatch()

    def _not_starting(self, entry: _Entry, st: _TenantState) -> None:
        if entry.starting:
            entry.starting = False
            st.starting -= 1
            self.starting -= 1

    def _release(self, entry: _Entry, used_tokens: Optional[int]) -> None:
        request = entry.request
        now = self.clock()
        self.admitted -= 1
        st = self.state(request.tenant.name)
        self._not_starting(entry, st)
        streamed = now - entry.first_at if entry.first_at is not None else 0.0
        st.service += streamed / request.tenant.weight - entry.charged  # the real cost
        st.ahead -= entry.charged
        if entry.first_at is not None:
            st.expected_s = streamed if st.expected_s is None else st.expected_s
            st.expected_s += EXPECTED_SMOOTHING * (streamed - st.expected_s)
            self._expected_s += EXPECTED_SMOOTHING * (streamed - self._expected_s)
        st.in_flight -= 1
        self.metrics.in_flight(request.tenant.name).dec()
        if used_tokens is not None and entry.charge is not None:
            entry.charge[1] = float(used_tokens)  # the usage replaces the estimate
        if self._last_release is not None:
            self._release_gap_s += 0.2 * (now - self._last_release - self._release_gap_s)
        self._last_release = now
        self.dispatch()

    # ------------------------------------------------------------------ waiting
    async def _wait(self, entry: _Entry) -> Slot:
        request = entry.request
        try:
            done, _ = await asyncio.wait({entry.future}, timeout=request.tenant.queue_timeout_s)
        except asyncio.CancelledError:
            self._abandon(entry)
            raise
        if done:
            entry.future.result()  # raises Shed when it was displaced
            return Slot(self, entry)
        self._remove(entry)
        self._refund(entry)
        self._shed_count(request, "queue_timeout")
        raise Shed(
            "queue_timeout",
            f"waited {request.tenant.queue_timeout_s:g} s in tenant "
            f"{request.tenant.name!r}'s queue (its queueTimeoutSeconds)",
            self._retry_after(request.priority),
        )

    def _abandon(self, entry: _Entry) -> None:
        """The client left: its slot back if it was just granted, else out of its queue."""
        band = str(entry.request.priority)
        self.metrics.abandoned(entry.request.tenant.name, band).inc()
        if entry.future.done():
            if entry.future.exception() is None:
                Slot(self, entry).release()
            return
        entry.future.cancel()
        self._remove(entry)
        self._refund(entry)

    def _remove(self, entry: _Entry) -> None:
        queue = self._bands.get(entry.request.priority, {}).get(entry.request.tenant.name)
        if queue is not None and entry in queue:
            queue.remove(entry)
            self._dequeued(entry)

    def _refund(self, entry: _Entry) -> None:
        if entry.charge is not None:
            entry.charge[1] = 0.0

    def _shed_count(self, request: FlowRequest, reason: str) -> None:
        self.metrics.shed(request.tenant.name, str(request.priority), reason).inc()

    def _retry_after(self, priority: int) -> float:
        """About when a place frees for this band: the requests queued at it or above,
        one per recent gap between releases."""
        ahead = sum(
            len(q)
            for band, tenants in self._bands.items()
            if band >= priority
            for q in tenants.values()
        )
        return (ahead + 1) * self._release_gap_s

    def queue_length(self, tenant: str) -> int:
        return self.state(tenant).queued

    def in_flight(self, tenant: str) -> int:
        return self.state(tenant).in_flight
