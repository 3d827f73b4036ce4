"""Pure request rewriting for each leg of the P/D flows, and reading of leg answers.

Every function here takes parsed JSON (dicts) and returns new dicts: no I/O, so each rule
of the protocol is unit-testable on its own. The rules follow vLLM's NixlConnector flow
(see docs/sidecar.md):

- decode-first leg: the client's request with the pool's `cache_hit_threshold` (the
  request's own value wins) and no client `kv_transfer_params`.
- prefill leg: `do_remote_decode: true`, token limits capped to 1, `stream: false`, and,
  when the decode engine described its cached prefix on rejection, those params so that
  prefill pulls the prefix instead of recomputing it.
- decode leg: the client's request (so its stream settings and limits come back) with the
  prefill's `kv_transfer_params` verbatim and the threshold set to 0.

Every leg keeps the request's `priority` (a front-end with flow control writes the tenant's
band there: routing/tenants.engine_priority), so both engines schedule it alike.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from pdpool.protocol import FINISH_CACHE_THRESHOLD

KV_PARAMS = "kv_transfer_params"
THRESHOLD = "cache_hit_threshold"
# Token limits a prefill leg caps to 1: it only has to fill the KV cache.
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens")
# Fields of the decode's cached-prefix description a prefill engine needs to pull it.
# remote_request_id names decode's hold on those blocks, released once prefill has read.
# pdpool_lease is the engine's lease on those blocks (signed with the pool secret), carried
# opaquely.
PULL_FIELDS = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_num_tokens",
    "tp_size",
    "pdpool_lease",
)


def effective_threshold(body: dict[str, Any], pool_threshold: float) -> float:
    """The request's own threshold wins over the pool's."""
    own = body.get(THRESHOLD)
    return float(own) if own is not None else float(pool_threshold)


def several_prompts(body: dict[str, Any]) -> bool:
    """A completion with a batch of prompts: each would need its own KV handoff, which one
    request's kv_transfer_params cannot carry, so it is served where it lands."""
    prompt = body.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))


def answers_prompt_logprobs(body: dict[str, Any]) -> bool:
    """The answer carries the prompt's logprobs (`prompt_logprobs`, or completions' `echo`
    with `logprobs`): only the engine that computes the prompt has them, so it is served
    where it lands, with no KV handoff."""
    if body.get("prompt_logprobs") is not None:
        return True
    return "prompt" in body and body.get("echo") is True and body.get("logprobs") is not None


def served_where_it_lands(body: dict[str, Any]) -> bool:
    return several_prompts(body) or answers_prompt_logprobs(body)


def decode_first_leg(body: dict[str, Any], pool_threshold: float) -> dict[str, Any]:
    leg = dict(body)
    leg[THRESHOLD] = effective_threshold(body, pool_threshold)
    leg.pop(KV_PARAMS, None)
    return leg


def pull_params_from_rejection(
    rejection_kv: Optional[dict[str, Any]], min_tokens: int = 0
) -> Optional[dict[str, Any]]:
    """The part of a rejection's `kv_transfer_params` a prefill engine needs to pull the
    decode engine's cached prefix; None when decode holds nothing worth pulling (fewer
    than `min_tokens` cached tokens: recomputing a short prefix beats a transfer)."""
    if not isinstance(rejection_kv, dict):
        return None
    blocks = rejection_kv.get("remote_block_ids")
    num_tokens = rejection_kv.get("remote_num_tokens")
    if not blocks or not num_tokens or not rejection_kv.get("remote_engine_id"):
        return None
    if isinstance(num_tokens, int) and num_tokens < min_tokens:
        return None
    return {k: rejection_kv[k] for k in PULL_FIELDS if rejection_kv.get(k) is not None}


def prefill_leg(body: dict[str, Any], pull: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    leg = copy.deepcopy(body)
    leg["stream"] = False
    leg.pop("stream_options", None)
    for name in TOKEN_LIMITS:
        leg[name] = 1
    if leg.get("min_tokens") is not None:
        leg["min_tokens"] = min(int(leg["min_tokens"]), 1)
    # Only one choice fills the cache; n>1 would just waste prefill compute. Its text is
    # never shown: no prompt to echo either.
    leg.pop("n", None)
    leg.pop("echo", None)
    leg.pop("prompt_logprobs", None)
    leg[THRESHOLD] = 0.0
    params: dict[str, Any] = dict(pull or {})
    params["do_remote_decode"] = True
    params["do_remote_prefill"] = False
    leg[KV_PARAMS] = params
    return leg


def decode_leg(body: dict[str, Any], prefill_kv: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The client's request again, with the prefill's params verbatim and threshold 0.

    With `prefill_kv` None this is the fallback: decode prefills locally."""
    leg = dict(body)
    leg[THRESHOLD] = 0.0
    if prefill_kv:
        leg[KV_PARAMS] = prefill_kv
    else:
        leg.pop(KV_PARAMS, None)
    return leg


def aggregated_leg(body: dict[str, Any]) -> dict[str, Any]:
    """Pass-through: never rejected, so the client never sees `cache_threshold`."""
    leg = dict(body)
    leg[THRESHOLD] = 0.0
    leg.pop(KV_PARAMS, None)
    return leg


# ---------------------------------------------------------------- reading answers


def finish_reasons(response: Any) -> list[Any]:
    if not isinstance(response, dict):
        return []
    choices = response.get("choices")
    if not isinstance(choices, list):
        return []
    return [c.get("finish_reason") for c in choices if isinstance(c, dict)]


def is_rejection(response: Any) -> bool:
    return FINISH_CACHE_THRESHOLD in finish_reasons(response)


def chunk_decides(chunk: Any) -> bool:
    """Whether a stream chunk shows if the request was accepted: it carries text or a
    finish reason. A chat stream's first chunk (role only) decides nothing yet."""
    if not isinstance(chunk, dict):
        return True
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            return True
        if choice.get("finish_reason") is not None:
            return True
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (
            delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")
        ):
            return True
    return False


def kv_params_of(response: Any) -> Optional[dict[str, Any]]:
    if isinstance(response, dict):
        kv = response.get(KV_PARAMS)
        if isinstance(kv, dict):
            return kv
    return None


# The engine route that ends a KV lease it granted (decode's prefix, after a rejection).
RELEASE_PATH = "/pdpool/v1/kv/release"


def prefill_answer_is_usable(kv: Optional[dict[str, Any]]) -> bool:
    """A prefill answer the decode engine can pull from."""
    return kv is not None and bool(kv.get("do_remote_prefill")) and bool(kv.get("remote_engine_id"))


def _usage_numbers(usage: Any) -> tuple[int, int]:
    """(prompt_tokens, cached_tokens) of a usage object, zeros when absent."""
    if not isinstance(usage, dict):
        return 0, 0
    prompt = usage.get("prompt_tokens") or 0
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") or 0 if isinstance(details, dict) else 0
    return int(prompt), int(cached)


def computed_tokens(usage: Any) -> int:
    """Prompt tokens a leg computed (not served from a local or pulled cache)."""
    prompt, cached = _usage_numbers(usage)
    return max(prompt - cached, 0)


def merged_usage(decode_usage: Any, prefill_usage: Any) -> Any:
    """The usage a client sees after a P/D run: counts from the decode leg, and
    `cached_tokens` = prompt tokens that neither leg had to compute, so that a client
    learns how much of its prompt came from a cache anywhere in the pool."""
    if not isinstance(decode_usage, dict):
        return decode_usage
    prompt, _ = _usage_numbers(decode_usage)
    spent = computed_tokens(decode_usage) + computed_tokens(prefill_usage)
    usage = dict(decode_usage)
    details = dict(usage.get("prompt_tokens_details") or {})
    details["cached_tokens"] = max(prompt - spent, 0)
    # Where the prompt's KV came from: the decode leg's split, with the prefill leg's own.
    if isinstance(details.get("pdpool"), dict):
        prefill_details = (
            prefill_usage.get("prompt_tokens_details") if isinstance(prefill_usage, dict) else None
        )
        split = dict(details["pdpool"])
        if isinstance(prefill_details, dict) and isinstance(prefill_details.get("pdpool"), dict):
            split["prefill"] = prefill_details["pdpool"]
        details["pdpool"] = split
    usage["prompt_tokens_details"] = details
    return usage
