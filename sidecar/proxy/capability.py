"""What the decode engine can do, for decode-first.

Decode-first relies on the engine rejecting a request whose prompt is too little cached
(`cache_hit_threshold`, `finish_reason: "cache_threshold"`). Upstream vLLM has no such field:
it ignores it and serves every request, so decode-first would silently never disaggregate.
For such an engine the sidecar decides itself, by prompt length: prompts of at least
`prefill_min_prompt_tokens` (estimated) go prefill-first, shorter ones straight to decode
(routing/pd.py decides, from what this module knows).

`engine_rejects`: `yes` (pdpool serve), `no` (vLLM; the operator renders this for
`engine.kind: vllm`), or `auto`: probe once, with a never-cached prompt and threshold 1.0;
an engine that honours the field answers `cache_threshold`, one that ignores it generates.
The probe runs in one background task from start-up until the engine answers, waiting
longer after each failure. Requests only read the answer, never wait for it: while it is
unknown they take plain decode-first (an engine that rejects is served as it should be,
one that cannot is served by decode alone).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Callable, Optional

import httpx

log = logging.getLogger("pdpool.sidecar")

ENGINE_REJECTS = ("auto", "yes", "no")
# Pauses between failed capability probes: the first short (an engine just starting),
# then doubling, so that an engine that never answers is asked twice a minute.
PROBE_RETRY_FIRST_S = 0.5
PROBE_RETRY_MAX_S = 30.0


class EngineCapability:
    """Whether the decode engine honours `cache_hit_threshold`: from the setting, or (auto)
    learned by `probe_until_known`. `known` is all a request reads (None: unknown)."""

    def __init__(self, setting: str, probe_timeout_s: float = 2.0) -> None:
        self.setting = setting
        self.known: Optional[bool] = {"yes": True, "no": False}.get(setting)
        self.probe_timeout_s = probe_timeout_s

    @property
    def gauge_value(self) -> int:
        return -1 if self.known is None else int(self.known)

    async def probe_until_known(
        self, client_fn: Callable[[], httpx.AsyncClient], decode_url: str
    ) -> None:
        """Probes, one probe at a time, until the engine answers. A failed probe (engine
        starting, busy, or answering oddly) is tried again after a pause that doubles up
        to PROBE_RETRY_MAX_S, so a sick engine is not pestered."""
        pause = PROBE_RETRY_FIRST_S
        while self.known is None:
            answer = await probe_rejects(client_fn(), decode_url, self.probe_timeout_s)
            if answer is not None:
                self.learn(answer)
                return
            await asyncio.sleep(pause)
            pause = min(pause * 2, PROBE_RETRY_MAX_S)

    def learn(self, rejects: bool) -> None:
        self.known = rejects
        if rejects:
            log.info("the decode engine honours cache_hit_threshold")
        else:
            log.warning(
                "the decode engine ignores cache_hit_threshold (e.g. stock "
                "vLLM): decode-first decides P/D by prompt length"
            )


async def probe_rejects(
    client: httpx.AsyncClient, decode_url: str, timeout: float = 2.0
) -> Optional[bool]:
    """True/False as the engine honours `cache_hit_threshold`; None when it cannot tell."""
    try:
        models = (await client.get(decode_url + "/v1/models", timeout=timeout)).json()
        model = models["data"][0]["id"]
        body: dict[str, Any] = {
            "model": model,
            "prompt": f"pdpool capability probe {uuid.uuid4().hex}",
            "max_tokens": 1,
            "temperature": 0,
            "cache_hit_threshold": 1.0,
        }
        resp = await client.post(
            decode_url + "/v1/completions",
            json=body,
            timeout=timeout,
            headers={"x-request-id": f"pdpool-probe-{uuid.uuid4().hex}"},
        )
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        log.info("engine capability probe failed: %r", exc)
        return None
    if 400 <= resp.status_code < 500:  # an engine that refuses the field cannot reject
        return False
    if resp.status_code != 200:
        return None
    try:
        reason = resp.json()["choices"][0].get("finish_reason")
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return bool(reason == "cache_threshold")
