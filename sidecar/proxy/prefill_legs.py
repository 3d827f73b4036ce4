"""Prefill legs: which prefill engine runs one, running it, and ending decode's lease on the
prefix it offered.

The order engines are tried in is `prefill_ranking.py`'s (KV events, else load); sick
engines are ejected by `outlier.py`, fed by the legs' outcomes and by the health probes
here. Prefill legs go through httpx (the upstream client shards).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Callable, Optional, Union

import httpx

from pdpool import tracing

from . import legs
from .adapter_legs import AdapterLegs
from .revision_legs import RevisionLegs
from ..net.asgi import raw_headers
from ..net.discovery import EndpointSet
from .exchange import Exchange, PrefillResult, json_or_none
from ..net.metrics import SidecarMetrics
from ..routing.outlier import EjectionRace, OutlierDetector
from ..routing.pool import EndpointPool
from ..routing.prefill_ranking import PrefillRanking
from .settings import SidecarSettings
from .span_attributes import prefill_result_attributes
from ..net.upstream import readiness
from .usage import json_usage

log = logging.getLogger("pdpool.sidecar")

# Outcomes of a prefill attempt that count against its engine (outlier detection).
ENGINE_FAILURES = ("timeout", "connect_error", "server_error")


def prefill_outliers(settings: SidecarSettings, metrics: SidecarMetrics) -> OutlierDetector:
    """Outlier detection of the prefill engines, ejections logged and counted."""

    def on_eject(endpoint: str, reason: str) -> None:
        log.warning("prefill engine %s ejected (%s)", endpoint, reason)
        tracing.moment("ejection", {"pdpool.endpoint": endpoint, "pdpool.reason": reason})
        metrics.prefill_ejections.labels(endpoint, reason).inc()
        metrics.prefill_ejected.labels(endpoint).set(1)

    def on_readmit(endpoint: str) -> None:
        log.warning("prefill engine %s readmitted", endpoint)
        metrics.prefill_ejected.labels(endpoint).set(0)

    return OutlierDetector(
        consecutive_failures=settings.outlier_failures,
        base_ejection_s=settings.ejection_s,
        on_eject=on_eject,
        on_readmit=on_readmit,
    )


@dataclass(eq=False)
class PrefillLegs:
    settings: SidecarSettings
    metrics: SidecarMetrics
    _: KW_ONLY
    pool: EndpointPool  # the prefill engines
    ranking: PrefillRanking
    next_client: Callable[[], httpx.AsyncClient]  # the upstream clients exist from startup on
    # Which prefill engines serve the request's adapter (loading it on one if allowed).
    adapters: AdapterLegs
    # Which prefill engines compute KV the decode engine can use (rollouts).
    revisions: RevisionLegs
    # Fire-and-forget lease releases, held until done.
    _background: set[asyncio.Future[None]] = field(default_factory=set, init=False, repr=False)

    async def run(self, ex: Exchange, leg: dict[str, Any]) -> PrefillResult:
        """Tries prefill engines in ranking order; an empty result means fallback."""
        started = time.perf_counter()
        with tracing.child("prefill", ex.span) as span:
            result = await self._run(ex, leg, span)
            if span is not None:
                tracing.set_attributes(span, prefill_result_attributes(result))
        if result.kv is not None:
            self.metrics.phase("prefill").observe(time.perf_counter() - started)
        return result

    async def _run(self, ex: Exchange, leg: dict[str, Any], span: Any) -> PrefillResult:
        ranked = await self._candidates(ex, span)
        candidates = await self.adapters.prefill_targets(ex.body.get("model"), ranked)
        if ranked and not candidates:  # no prefill engine can run it under its adapter
            tracing.set_attributes(span, {"pdpool.prefill.adapter": "decode_only"})
            return PrefillResult()
        same = self.revisions.same_revision(candidates)
        if candidates and not same:  # every prefill engine is of another revision
            tracing.set_attributes(span, {"pdpool.prefill.revision": "decode_only"})
            return PrefillResult()
        candidates = same
        for endpoint in candidates:
            self.metrics.legs.labels("prefill").inc()
            started = time.perf_counter()
            with tracing.child(
                "prefill_attempt", span, "client", {"pdpool.endpoint": endpoint}
            ) as attempt:
                outcome, result = await self._attempt(ex, endpoint, leg, attempt)
                tracing.set_attributes(attempt, {"pdpool.outcome": outcome})
            self.metrics.prefill_attempts.labels(outcome).inc()
            if outcome in ENGINE_FAILURES:
                self.pool.outliers.failure(endpoint, outcome)
            elif outcome != "ejected":
                self.pool.outliers.success(endpoint)
            if outcome == "ok":
                self.metrics.prefill_seconds.observe(time.perf_counter() - started)
                ex.reply_headers["x-pdpool-prefill-endpoint"] = endpoint
            if result is not None:  # "ok" or "client_error": the answer goes on
                return result
            log.warning("prefill on %s failed (%s) for %s", endpoint, outcome, ex.request_id)
        if not candidates:
            self.metrics.prefill_attempts.labels("no_endpoint").inc()
        return PrefillResult()

    async def _candidates(self, ex: Exchange, span: Any = None) -> list[str]:
        # Ejected engines are skipped (also a trusted x-prefiller-host-port naming them);
        # when all are ejected, decode prefills itself (fallback).
        # Several named (llm-d's comma-separated list): the least loaded of them goes first.
        outliers = self.pool.outliers
        due = outliers.due(self.pool.current)
        if due:
            # Probe them now rather than at the next round: an engine that has just come up
            # (or back) serves this leg instead of leaving it to decode.
            await self.pool.probe_all(self._probe, due)
        named = [t for t in ex.targets if not outliers.is_ejected(t)]
        preferred = self.pool.by_load(named)[0] if named else None
        await self.ranking.sync(self.pool.current)  # prefill pods come and go
        candidates, ranked_by = await self.ranking.order(self.pool.available(), preferred, ex.body)
        self.metrics.prefill_ranking.labels(ranked_by).inc()
        tracing.set_attributes(
            span, {"pdpool.prefill.ranked_by": ranked_by, "pdpool.prefill.candidates": candidates}
        )
        return candidates

    async def _attempt(
        self, ex: Exchange, endpoint: str, leg: dict[str, Any], span: Any = None
    ) -> tuple[str, Optional[PrefillResult]]:
        """(outcome, the result when the answer goes on: "ok" or "client_error")."""
        with self.pool.tracked(endpoint):
            answer = await self._post_unless_ejected(ex, endpoint, leg, span)
        if isinstance(answer, str):
            return answer, None
        if answer.status_code == 429 or answer.status_code >= 500:
            return "server_error", None
        if answer.status_code == 404 and self.adapters.is_adapter(ex.body.get("model")):
            # It listed the adapter a moment ago and has unloaded it since: another engine,
            # or decode alone, never this 404 as the answer.
            self.adapters.forget(endpoint)
            return "adapter_missing", None
        if answer.status_code >= 400:
            return "client_error", PrefillResult(client_error=(answer.status_code, answer.content))
        data = json_or_none(answer.content)
        kv = legs.kv_params_of(data)
        if not legs.prefill_answer_is_usable(kv):
            # An engine without a KV connector: its prefill is useless to decode.
            return "no_kv", None
        return "ok", PrefillResult(kv=kv, usage=json_usage(data))

    async def _post_unless_ejected(
        self, ex: Exchange, endpoint: str, leg: dict[str, Any], span: Any = None
    ) -> Union[httpx.Response, str]:
        """The engine's answer, or why there is none ("ejected", "timeout", "connect_error").

        Given up as soon as the engine is ejected (a probe found it wedged): the request
        moves on to the next engine instead of waiting out its timeout."""
        url = f"{self.settings.upstream_scheme}://{endpoint}{ex.route}"
        headers = ex.headers if span is None else tracing.inject(span, ex.headers)
        call = self.next_client().post(url, json=leg, headers=raw_headers(headers))
        async with EjectionRace(self.pool.outliers, endpoint, call, httpx.HTTPError) as race:
            outcome = await race.wait(self.settings.prefill_timeout or None)
        if outcome != "done":
            return outcome
        try:
            return race.result()
        except asyncio.CancelledError:
            return "timeout"
        except httpx.HTTPError:
            return "connect_error"

    def release_decode_lease(self, params: dict[str, Any], span: Any = None) -> None:
        """Ends decode's lease on its cached prefix in the background (it would expire on its
        own; ending it now frees those blocks sooner)."""

        lease = params.get("pdpool_lease")
        tracing.event(
            span,
            "decode_lease_released",
            {"pdpool.kv.lease": lease.get("id", "") if isinstance(lease, dict) else ""},
        )

        async def release() -> None:
            try:
                await self.next_client().post(
                    self.settings.decode_url + legs.RELEASE_PATH,
                    json={"kv_transfer_params": params},
                    timeout=5.0,
                )
            except httpx.HTTPError as exc:  # it expires on its own soon
                log.info("releasing decode's KV lease failed: %s", exc)

        task = asyncio.ensure_future(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def probe_forever(self) -> None:
        """Health probes of every prefill engine with a short timeout: a wedged engine
        (accepts connections, answers nothing) is ejected within a few seconds, and an
        ejected one comes back once it answers again."""
        while True:
            await asyncio.sleep(self.settings.probe_interval_s)
            current = self.pool.current
            self.pool.outliers.forget(current)
            self.revisions.refresh(current)
            try:
                await self.pool.probe_all(self._probe, current)
            except Exception:  # a probe bug must not end the loop
                log.exception("prefill probe failed")

    async def _probe(self, endpoint: str) -> bool:
        """Whether a prefill engine is ready: its /ready (an engine whose loop is stuck is
        not ready); /health where an engine has none (vLLM: any answer but 200 or 503)."""
        timeout = self.settings.probe_timeout_s or None
        base = f"{self.settings.upstream_scheme}://{endpoint}"
        try:
            r = await readiness(self.next_client(), base, timeout)
            ok = r.status_code == 200
            if not ok:
                log.warning(
                    "probe of prefill engine %s: %s %s", endpoint, r.status_code, r.text[:200]
                )
        except httpx.HTTPError as exc:
            ok = False
            log.warning("probe of prefill engine %s failed: %r", endpoint, exc)
        return ok


def prefill_pool(settings: SidecarSettings, metrics: SidecarMetrics) -> EndpointPool:
    """The prefill engines of a sidecar: discovery, legs in flight, ejection (logged and
    counted) and probes, every probed engine with its 0/1 ejected series (a dashboard's
    "ejected" panel shows the healthy ones too, not only those ever ejected)."""

    def on_mark(endpoint: str) -> None:
        ejected = pool.outliers.is_ejected(endpoint)
        metrics.prefill_ejected.labels(endpoint).set(1 if ejected else 0)

    pool = EndpointPool(
        EndpointSet(settings.prefill_urls, settings.prefill_service, settings.prefill_refresh_s),
        prefill_outliers(settings, metrics),
        on_mark=on_mark,
    )
    return pool
