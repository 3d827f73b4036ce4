"""What the decode engine can do, for decode-first.

Decode-first relies on the engine rejecting a request whose prompt is too little cached
(`cache_hit_threshold`, `finish_reason: "cache_threshold"`). Upstream vLLM has no such field:
it ignores it and serves every request, so decode-first would silently never disaggregate.
For such an engine the sidecar decides itself, by prompt length: prompts of at least
`prefill_min_prompt_tokens` (estimated) go prefill-first, shorter ones straight to decode.

`engine_rejects`: `yes` (pdpool serve), `no` (vLLM; the operator renders this for
`engine.kind: vllm`), or `auto`: probe once, with a never-cached prompt and threshold 1.0;
an engine that honours the field answers `cache_threshold`, one that ignores it generates.
The probe runs from start-up until the engine answers (a request that finds the answer
still unknown waits for one probe, at most 2 s); while it is unknown, plain decode-first.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from typing import Any, Callable, Optional

import httpx

log = logging.getLogger("pdpool.sidecar")

ENGINE_REJECTS = ("auto", "yes", "no")
# llm-d's scheduler estimates prompt tokens from characters the same way (4 per token).
CHARS_PER_TOKEN = 4
PROBE_RETRY_S = 5.0


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens of a completions or chat body, estimated without a tokenizer: token-id
    prompts exactly, text as ceil(characters / 4) (the longest prompt of a batch)."""
    if "messages" in body:
        chars = 0
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(
                    len(part.get("text") or "") for part in content if isinstance(part, dict)
                )
        return math.ceil(chars / CHARS_PER_TOKEN)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return math.ceil(len(prompt) / CHARS_PER_TOKEN)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return len(prompt)
        return max(estimate_prompt_tokens({"prompt": p}) for p in prompt)
    return 0


class EngineCapability:
    """Whether the decode engine honours `cache_hit_threshold` (probed for `auto`: in the
    background from start-up until an answer, and by a request that finds it unknown)."""

    def __init__(self, setting: str, probe_timeout_s: float = 2.0) -> None:
        self.setting = setting
        self.known: Optional[bool] = {"yes": True, "no": False}.get(setting)
        self.probe_timeout_s = probe_timeout_s
        self._lock = asyncio.Lock()
        self._next_probe = 0.0

    @property
    def gauge_value(self) -> int:
        return -1 if self.known is None else int(self.known)

    async def rejects(self, client: httpx.AsyncClient, decode_url: str) -> Optional[bool]:
        """True/False once known; None while the engine cannot be asked (then the caller
        keeps plain decode-first: an engine that rejects is served as before)."""
        if self.known is not None:
            return self.known
        async with self._lock:  # one probe at a time; the others wait for its answer
            if self.known is None and time.monotonic() >= self._next_probe:
                self.known = await probe_rejects(client, decode_url, self.probe_timeout_s)
                if self.known is None:
                    self._next_probe = time.monotonic() + PROBE_RETRY_S
                elif self.known:
                    log.info("the decode engine honours cache_hit_threshold")
                else:
                    log.warning(
                        "the decode engine ignores cache_hit_threshold (e.g. stock "
                        "vLLM): decode-first decides P/D by prompt length"
                    )
        return self.known

    async def probe_until_known(
        self, client_fn: Callable[[], httpx.AsyncClient], decode_url: str, interval_s: float = 1.0
    ) -> None:
        while self.known is None:
            self._next_probe = 0.0
            await self.rejects(client_fn(), decode_url)
            if self.known is None:
                await asyncio.sleep(interval_s)


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
