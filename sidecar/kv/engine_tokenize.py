"""Token ids of a generation request from a decode engine's /tokenize (vLLM's API), for the
prompts a gateway cannot tokenize itself: every chat (the chat template lives with the
model) and string prompts when it has no tokenizer.json (a gateway pod has no model).

Pure functions (the /tokenize body for a request, and the ids from the answer) and
`EngineTokenizer`, which asks a decode engine through its sidecar (which passes /tokenize
through). The engine tokenizes exactly as its generation endpoints do (same defaults), so
the ids hash to the blocks that engine publishes."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import httpx

from pdpool.prompt_truncation import ids_the_engine_keeps

from ..net.asgi import raw_headers
from ..net.metrics import GatewayMetrics

log = logging.getLogger("pdpool.routing")

# The client's headers an engine's /tokenize may see: never its credentials (Authorization,
# x-api-key), which go no further than the front-end whatever the request's own leg does.
PASSED_HEADERS = ("x-request-id",)

# Fields of a chat request that change its rendering; vLLM's /tokenize takes them all.
CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


def tokenize_body(body: Any) -> Optional[dict[str, Any]]:
    """The /tokenize body that yields `body`'s prompt ids; None when /tokenize cannot say
    (token ids already, several prompts, nothing to tokenize)."""
    if not isinstance(body, dict):
        return None
    model = {"model": body["model"]} if "model" in body else {}
    if isinstance(body.get("messages"), list):
        fields = {k: body[k] for k in CHAT_FIELDS if k in body}
        return {**model, "messages": body["messages"], **fields}
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # one prompt in a list is that prompt
    if isinstance(prompt, str):
        fields = (
            {"add_special_tokens": body["add_special_tokens"]}
            if "add_special_tokens" in body
            else {}
        )
        return {**model, "prompt": prompt, **fields}
    return None


def token_ids_of(answer: Any, body: dict[str, Any]) -> Optional[list[int]]:
    """The ids of a /tokenize answer, as the engine keeps them for `body` (its truncation
    applied: /tokenize does not truncate, and gives the context -1 needs); None for
    anything else."""
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        return None
    context = answer.get("max_model_len")
    return ids_the_engine_keeps(tokens, body, context if type(context) is int else None)


class EngineTokenizer:
    def __init__(
        self,
        client: Callable[[], Optional[httpx.AsyncClient]],
        scheme: str,
        timeout_s: float,
        healthy: Callable[[str], bool],
        metrics: GatewayMetrics,
    ) -> None:
        self.client, self.scheme, self.timeout_s = client, scheme, timeout_s
        self.healthy, self.metrics = healthy, metrics

    async def __call__(
        self, body: Any, order: list[str], headers: dict[str, str]
    ) -> Optional[list[int]]:
        """The prompt's ids from the first healthy backend's engine; None when that cannot
        be had in time."""
        ask = tokenize_body(body)
        backend = next((b for b in order if self.healthy(b)), None)
        client = self.client()
        if ask is None or backend is None or client is None:
            return None
        passed = {k: v for k, v in headers.items() if k in PASSED_HEADERS}
        try:
            resp = await client.post(
                f"{self.scheme}://{backend}/tokenize",
                json=ask,
                headers=raw_headers(passed),
                timeout=self.timeout_s,
            )
            ids = token_ids_of(resp.json(), body) if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("tokenize on %s failed: %s", backend, exc)
            ids = None
        self.metrics.kv_engine_tokenize.labels("ok" if ids is not None else "failed").inc()
        return ids
