"""`truncate_prompt_tokens`, as vLLM's OpenAI server has it: a prompt longer than N tokens
keeps its last N (or, with `truncation_side: "right"`, its first N); -1 means as many as
the context holds with one token left to generate. Pure functions: the translator applies
them to a completion's prompt (text or ids) and to a chat's rendered template."""

from __future__ import annotations

from typing import Any, Optional


class TruncationError(ValueError):
    """The request's truncation cannot be served by this model."""


def truncation_tokens(requested: Optional[int], max_model_len: int) -> Optional[int]:
    """How many prompt tokens the request keeps (None: no truncation)."""
    if requested is None:
        return None
    if requested == -1:
        return max(max_model_len - 1, 1)
    if requested < 1:
        raise TruncationError(f"truncate_prompt_tokens must be -1 or at least 1, got {requested}")
    if requested > max_model_len:
        raise TruncationError(
            f"truncate_prompt_tokens={requested} cannot be greater than max_model_len="
            f"{max_model_len}; ask for a smaller truncation size"
        )
    return requested


def cut_text(text: str, max_chars: int, side: str) -> str:
    """At most `max_chars` characters of `text`, from the side truncation keeps: what a
    truncated prompt may tokenize at most (the refusal bound of an untruncated one, as in
    vLLM), so a huge text costs no more tokenizer time than the longest prompt served."""
    if len(text) <= max_chars:
        return text
    return text[-max_chars:] if side == "left" else text[:max_chars]


def truncate_ids(ids: list[int], keep: Optional[int], side: str) -> list[int]:
    """The prompt's token ids truncation keeps."""
    if keep is None or len(ids) <= keep:
        return ids
    return ids[-keep:] if side == "left" else ids[:keep]


def ids_the_engine_keeps(
    ids: list[int], body: dict[str, Any], max_model_len: Optional[int] = None
) -> list[int]:
    """For a router: `ids` as an engine truncates them for the request `body` (unchecked, as
    the client sent it). -1 needs the engine's context, `max_model_len`: without it the ids
    stay whole, and so does any value the engine would refuse."""
    requested, side = body.get("truncate_prompt_tokens"), body.get("truncation_side") or "left"
    if type(requested) is not int or side not in ("left", "right"):
        return ids
    if requested == -1 and max_model_len is not None:
        requested = truncation_tokens(-1, max_model_len)
    return truncate_ids(ids, requested, side) if requested > 0 else ids
