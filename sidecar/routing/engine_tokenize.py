"""Token ids of a generation request from a decode engine's /tokenize (vLLM's API), for the
prompts a gateway cannot tokenize itself: every chat (the chat template lives with the
model) and string prompts when it has no tokenizer.json (a gateway pod has no model).

Pure functions: the /tokenize body for a request, and the ids from the answer. The engine
tokenizes exactly as its generation endpoints do (same defaults), so the ids hash to the
blocks that engine publishes."""

from __future__ import annotations

from typing import Any, Optional

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


def token_ids_of(answer: Any) -> Optional[list[int]]:
    """The ids of a /tokenize answer; None for anything else."""
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if isinstance(tokens, list) and all(type(t) is int and t >= 0 for t in tokens):
        return tokens
    return None
