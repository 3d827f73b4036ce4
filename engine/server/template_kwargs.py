"""vLLM's `chat_template_kwargs`: more variables for the chat template (Qwen3's
`enable_thinking`, for one). Pure functions; no I/O."""

from __future__ import annotations

from typing import Any, Optional

from pdpool.protocol import RequestError

# Variables the request sets through its own fields, that say how to render rather than
# what, or that name the helpers a template calls: naming them here is refused, not
# silently applied or dropped.
RESERVED = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "raise_exception",
        "strftime_now",
    }
)


def template_kwargs(
    raw: Optional[dict[str, Any]], template_variables: Optional[frozenset[str]]
) -> dict[str, Any]:
    """The variables to render with: those the template reads (vLLM drops the others);
    all of them when the template's variables are not known. RequestError for a
    reserved name."""
    if not raw:
        return {}
    reserved = sorted(RESERVED & raw.keys())
    if reserved:
        raise RequestError(
            f"chat_template_kwargs may not set {', '.join(reserved)} "
            "(a request field, a rendering option or a helper the template calls)",
            "chat_template_kwargs",
        )
    if template_variables is None:
        return dict(raw)
    return {name: value for name, value in raw.items() if name in template_variables}
