"""Logprobs in OpenAI's (and vLLM's) response shapes.

Values are what the sampler reports: the log-softmax of the raw model logits (vLLM v1's
default `raw_logprobs`), before min_tokens masking, temperature, top-k and top-p.

- /v1/completions: `{tokens, token_logprobs, top_logprobs, text_offset}`; each
  `top_logprobs[i]` maps token text to logprob for the `logprobs` most likely tokens, best
  first, plus the sampled token when it is not among them (so `logprobs` or `logprobs + 1`
  entries, as vLLM). `text_offset` counts characters of the token texts from 0.
- /v1/chat/completions: `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}]}` with exactly `top_logprobs` entries, best first.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from pdpool.engine.engine_state import ServerTokenizer
from pdpool.engine.outputs import TokenLogprob

# JSON has no -inf; vLLM clamps the same way.
_FLOOR = -9999.0


class TokenText:
    """Token id -> the text shown for it (or vLLM's `token_id:<id>`), cached."""

    def __init__(self, tokenizer: ServerTokenizer, as_ids: bool = False) -> None:
        self.tokenizer, self.as_ids = tokenizer, as_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


def _lp(value: float) -> float:
    return max(value, _FLOOR)


def completion_formatter(text_of: TokenText) -> Callable[[list[TokenLogprob]], dict[str, Any]]:
    """Formats the logprobs of one choice chunk by chunk; text_offset carries over."""
    offset = 0

    def fmt(lps: list[TokenLogprob]) -> dict[str, Any]:
        nonlocal offset
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for lp in lps:
            token = text_of(lp.token_id)
            out["tokens"].append(token)
            out["token_logprobs"].append(_lp(lp.logprob))
            top = {text_of(i): _lp(v) for i, v in lp.top}
            top.setdefault(token, _lp(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(token)
        return out

    return fmt


def merge_completion(parts: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    if not parts:
        return None
    merged: dict[str, list[Any]] = {
        k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
    for part in parts:
        for k in merged:
            merged[k].extend(part[k])
    return merged


def _chat_entry(text_of: TokenText, token_id: int, logprob: float) -> dict[str, Any]:
    token = text_of(token_id)
    return {
        "token": token,
        "logprob": _lp(logprob),
        "bytes": list(token.encode("utf-8", errors="replace")),
    }


def chat_formatter(text_of: TokenText) -> Callable[[list[TokenLogprob]], dict[str, Any]]:
    def fmt(lps: list[TokenLogprob]) -> dict[str, Any]:
        return {
            "content": [
                {
                    **_chat_entry(text_of, lp.token_id, lp.logprob),
                    "top_logprobs": [_chat_entry(text_of, i, v) for i, v in lp.top],
                }
                for lp in lps
            ]
        }

    return fmt


def merge_chat(parts: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    if not parts:
        return None
    return {"content": [c for part in parts for c in part["content"]]}
