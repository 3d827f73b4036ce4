"""Logprobs in OpenAI's (and vLLM's) response shapes.

Values are what the sampler reports: the log-softmax of the raw model logits (vLLM v1's
default `raw_logprobs`), before min_tokens masking, temperature, top-k and top-p.

- /v1/completions: `{tokens, token_logprobs, top_logprobs, text_offset}`; each
  `top_logprobs[i]` maps token text to logprob for the `logprobs` most likely tokens, best
  first, plus the sampled token when it is not among them (so `logprobs` or `logprobs + 1`
  entries, as vLLM). `text_offset` counts characters of the token texts from 0.
- /v1/chat/completions: `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}]}` with exactly `top_logprobs` entries, best first.

A token that is part of a character split over several tokens (byte-level pieces) decodes
alone to a replacement character; as vLLM, its text is then read with the choice's
preceding sampled tokens: the piece that completes the character shows it, the pieces
before it show "".
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Iterator, Optional

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

    def after(self, token_id: int, context: list[int]) -> str:
        """The token's text where it follows `context` (the sampled ids before it)."""
        text = self(token_id)
        if self.as_ids or not text.endswith(REPLACEMENT):
            return text
        return completed_character(self.tokenizer.decode, token_id, context)


REPLACEMENT = "\ufffd"
# A UTF-8 character has at most 4 bytes: 4 earlier tokens are enough context.
MAX_CONTEXT = 4


def completed_character(
    decode: Callable[[list[int]], str], token_id: int, context: list[int]
) -> str:
    """The text a byte-level piece adds after `context`: with the fewest preceding tokens
    that make a whole character, the decoded text past the earlier tokens that decode whole
    themselves (the unfinished pieces before it showed "", so their bytes are shown here);
    "" while the character is still unfinished."""
    context = context[-MAX_CONTEXT:]
    for n in range(1, len(context) + 1):
        before = context[-n:]
        whole = decode([*before, token_id])
        if whole.endswith(REPLACEMENT):
            continue
        clean = len(before)
        while clean > 0 and decode([before[clean - 1]]).endswith(REPLACEMENT):
            clean -= 1
        prefix = decode(before[:clean]) if clean else ""
        if whole.startswith(prefix):
            return whole[len(prefix) :]
        common = 0
        while common < min(len(prefix), len(whole)) and prefix[common] == whole[common]:
            common += 1
        return whole[common:]
    return ""


class SampledContext:
    """The last sampled token ids of one choice, for `TokenText.after`."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def push(self, token_id: int) -> None:
        self.ids = [*self.ids, token_id][-MAX_CONTEXT:]


def _lp(value: float) -> float:
    return max(value, _FLOOR)


def completion_formatter(text_of: TokenText) -> Callable[[list[TokenLogprob]], dict[str, Any]]:
    """Formats the logprobs of one choice chunk by chunk; text_offset carries over."""
    offset = 0
    sampled = SampledContext()

    def fmt(lps: list[TokenLogprob]) -> dict[str, Any]:
        nonlocal offset
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for lp in lps:
            token = text_of.after(lp.token_id, sampled.ids)
            out["tokens"].append(token)
            out["token_logprobs"].append(_lp(lp.logprob))
            top = {text_of.after(i, sampled.ids): _lp(v) for i, v in lp.top}
            top.setdefault(token, _lp(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(token)
            sampled.push(lp.token_id)
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


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {
        "token": token,
        "logprob": _lp(logprob),
        "bytes": list(token.encode("utf-8", errors="replace")),
    }


def chat_formatter(text_of: TokenText) -> Callable[[list[TokenLogprob]], dict[str, Any]]:
    sampled = SampledContext()

    def fmt(lps: list[TokenLogprob]) -> dict[str, Any]:
        content = []
        for lp in lps:
            entry = _chat_entry(text_of.after(lp.token_id, sampled.ids), lp.logprob)
            entry["top_logprobs"] = [
                _chat_entry(text_of.after(i, sampled.ids), v) for i, v in lp.top
            ]
            content.append(entry)
            sampled.push(lp.token_id)
        return {"content": content}

    return fmt


def merge_chat(parts: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    if not parts:
        return None
    return {"content": [c for part in parts for c in part["content"]]}


def _generate_candidate(token_id: int, logprob: float, rank: Optional[int]) -> dict[str, Any]:
    # vLLM: NaN and -inf are -9999.0; a rank of 0 (a NaN logprob's) is none
    value = _FLOOR if math.isnan(logprob) else _lp(logprob)
    return {"token_id": token_id, "logprob": value, "rank": rank or None}


def generate_formatter(num_top: int) -> Callable[[list[TokenLogprob]], dict[str, Any]]:
    """vLLM's GenerateLogProbs of one choice's new tokens (/inference/v1/generate: token
    ids, no text). Each sampled token with its logprob and rank, and as `top_logprobs` the
    first max(`num_top`, 1) of vLLM's candidates: the sampled token, then the likeliest
    others in rank order. A sampled token among the likeliest takes its top-k rank, as in
    vLLM's map."""
    shown = max(num_top, 1)

    def entry(lp: TokenLogprob) -> dict[str, Any]:
        rank = next((r for r, (t, _) in enumerate(lp.top, 1) if t == lp.token_id), lp.rank)
        top = [_generate_candidate(lp.token_id, lp.logprob, rank)]
        for r, (token, value) in enumerate(lp.top, 1):
            if len(top) == shown:
                break
            if token != lp.token_id:
                top.append(_generate_candidate(token, value, r))
        return {**top[0], "top_logprobs": top}

    return lambda lps: {"content": [entry(lp) for lp in lps]}


# Entries (a token's logprob, or one of its likeliest) of prompt logprobs in one answer, all
# its choices together: about 75 bytes of JSON each, so about 20 MB. Every choice repeats its
# prompt's, so a long prompt times many choices would otherwise make a huge answer.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 18


def check_prompt_logprobs_size(
    prompt_lengths: list[int], per_prompt: int, num_top: int, copies: int
) -> None:
    """ValueError when the prompts' logprobs (`num_top` likeliest and the token's own per
    prompt token, in `copies` places of each of `per_prompt` choices) pass the bound."""
    entries = sum(max(n - 1, 0) for n in prompt_lengths) * (num_top + 1) * per_prompt * copies
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise ValueError(
            f"the prompts' logprobs would take {entries} entries in the answer (at most "
            f"{MAX_PROMPT_LOGPROB_ENTRIES}): ask for fewer likeliest tokens or choices, or a "
            "shorter prompt"
        )


def _prompt_rows(
    entries: list[TokenLogprob], text_of: TokenText
) -> Iterator[tuple[TokenLogprob, Callable[[int], str]]]:
    """Each scored prompt token with the text of a token at its place: as for sampled
    tokens, a byte-level piece is read with the prompt tokens before it (vLLM takes those
    from the second prompt token on: the first has no row)."""
    context = SampledContext()
    for lp in entries:
        yield lp, functools.partial(text_of.after, context=context.ids)
        context.push(lp.token_id)


def vllm_prompt_logprobs(
    prompt_ids: list[int], entries: list[TokenLogprob], text_of: TokenText
) -> list[Optional[dict[str, Any]]]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then for each later one
    {token id: {logprob, rank, decoded_token}}, the prompt token first, then the most
    likely (ranks 1..k; one of them that is the prompt token takes its top-k rank, as
    vLLM's)."""
    out: list[Optional[dict[str, Any]]] = [None] if prompt_ids else []
    for lp, text in _prompt_rows(entries, text_of):
        row = {str(lp.token_id): _prompt_entry(lp.logprob, lp.rank, text(lp.token_id))}
        for rank, (token, value) in enumerate(lp.top, start=1):
            row[str(token)] = _prompt_entry(value, rank, text(token))
        out.append(row)
    return out


def _prompt_entry(logprob: float, rank: Optional[int], text: str) -> dict[str, Any]:
    return {"logprob": _lp(logprob), "rank": rank, "decoded_token": text}


def echoed_prompt_logprobs(
    prompt_ids: list[int], entries: list[TokenLogprob], text_of: TokenText, num_top: int
) -> dict[str, Any]:
    """The prompt's part of an echoed completion's logprobs (completions' `echo` with
    `logprobs`): the first token with none, then each token's and, as vLLM, up to
    `num_top` + 1 likeliest there (the prompt token first)."""
    out: dict[str, list[Any]] = {
        "tokens": [text_of(prompt_ids[0])] if prompt_ids else [],
        "token_logprobs": [None] if prompt_ids else [],
        "top_logprobs": [None] if prompt_ids else [],
        "text_offset": [0] if prompt_ids else [],
    }
    for lp, text in _prompt_rows(entries, text_of):
        token = text(lp.token_id)
        top = {token: _lp(lp.logprob)}
        for t, v in lp.top:
            if len(top) > num_top:
                break
            top[text(t)] = _lp(v)
        out["text_offset"].append(out["text_offset"][-1] + len(out["tokens"][-1]))
        out["tokens"].append(token)
        out["token_logprobs"].append(_lp(lp.logprob))
        out["top_logprobs"].append(top)
    for token_id in prompt_ids[len(out["tokens"]) :]:  # unscored (none here): shown bare
        out["text_offset"].append(out["text_offset"][-1] + len(out["tokens"][-1]))
        out["tokens"].append(text_of(token_id))
        out["token_logprobs"].append(None)
        out["top_logprobs"].append(None)
    return out


def after_prompt(prompt: dict[str, Any], generated: Optional[dict[str, Any]]) -> dict[str, Any]:
    """A completion's logprobs with the echoed prompt's before its generated tokens' (whose
    text offsets move past the prompt's tokens)."""
    if not generated:
        return prompt
    shift = (prompt["text_offset"][-1] + len(prompt["tokens"][-1])) if prompt["tokens"] else 0
    return {
        "tokens": prompt["tokens"] + generated["tokens"],
        "token_logprobs": prompt["token_logprobs"] + generated["token_logprobs"],
        "top_logprobs": prompt["top_logprobs"] + generated["top_logprobs"],
        "text_offset": prompt["text_offset"] + [o + shift for o in generated["text_offset"]],
    }
