"""Request migration: a stream whose decode path dies goes on elsewhere, exactly.

The gateway asks every streamed generation for token ids (`return_token_ids: true`, vLLM's
request extension: the first chunk carries `prompt_token_ids`, every chunk its
`token_ids`). When the stream breaks (connection lost, an error event, a stall, the backend
ejected), the gateway sends a *continuation* to another decode path: a `/v1/completions`
request whose prompt is the token ids of the original prompt (for chat: the rendered chat
template, as the engine tokenized it) plus the tokens already relayed, with the remaining
`max_tokens`. Greedy decoding of that prompt yields exactly the tokens the broken stream
would have produced next; the client sees one stream in its own shape (chat chunks stay
chat chunks, one id) with usage covering the whole request.

Tokens whose text the engine had not yet emitted (an incomplete UTF-8 sequence is held
back) are not part of the continuation's prompt: they are generated again, so their text
is not lost. Pure helpers here; the I/O is in gateway.py.

A guided stream (response_format, structured_outputs, guided_*) goes on under the same
constraint: the continuation carries it as `structured_outputs` plus the tokens already sent
(`guided_prefix_token_ids`, pdpool's extension), over which the engine advances the grammar
before it samples. Streams with tools are not migrated: a completion cannot go on parsing
tool calls in the chat's shape.
"""

from __future__ import annotations

from typing import Any, Optional

# Body fields that a /v1/completions continuation cannot take over from the original.
_NOT_CONTINUED = (
    "messages",
    "prompt",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    # The prompt's logprobs came with the first leg; asking again would recompute every
    # row of the longer prompt, its cached prefix unused.
    "prompt_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "echo",
    "suffix",
    "n",
    "best_of",
    "kv_transfer_params",
    "stream_options",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    # The continuation's prompt is the kept prompt already, plus what was generated.
    "truncate_prompt_tokens",
    "truncation_side",
)
TOKEN_IDS = "return_token_ids"


# Constraint fields a continuation keeps as they are (both routes take them).
_GUIDED = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
GUIDED_PREFIX = "guided_prefix_token_ids"


def guided_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The body's output constraint as /v1/completions takes it ({} when unguided)."""
    fields = {k: body[k] for k in _GUIDED if body.get(k) is not None}
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "json_object":
        fields["structured_outputs"] = {"json_object": True}
    elif isinstance(rf, dict) and rf.get("type") == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema", {})
        fields["structured_outputs"] = {"json": schema}
    return fields


def can_migrate(route: str, body: Any) -> bool:
    """Streams of one choice without echo or logprobs (a continuation cannot repeat
    them)."""
    if not isinstance(body, dict) or body.get("stream") is not True:
        return False
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return False
    if body.get("echo") or body.get("logprobs") or body.get("tools"):
        return False
    # These count the output's tokens, which a continuation would see as its prompt.
    if body.get("presence_penalty") or body.get("frequency_penalty"):
        return False
    return route in ("/v1/completions", "/v1/chat/completions")


def max_tokens_of(body: dict[str, Any], default: int) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


class StreamState:
    """What the client has been sent of one streamed request, across legs."""

    def __init__(self, route: str, body: dict[str, Any], default_max_tokens: int = 16) -> None:
        self.chat = route.endswith("/chat/completions")
        self.body = body
        self.client_wants_ids = bool(body.get(TOKEN_IDS))
        options = body.get("stream_options")
        self.include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        self.max_tokens = max_tokens_of(body, default_max_tokens)
        self.prompt_ids: Optional[list[int]] = None
        self.committed: list[int] = []  # tokens whose text reached the client
        self.pending: list[int] = []  # tokens whose text is still held back
        self.base_committed = 0  # tokens before the current leg
        self.finished = False  # a finish_reason reached the client
        self.done = False  # [DONE] reached the client
        self.usage_sent = False
        self.identity: dict[str, Any] = {}  # id, created, model of the client stream
        self.legs = 0  # continuations sent

    # ------------------------------------------------------------------ reading
    def observe(self, chunk: dict[str, Any], continuation: bool) -> Optional[dict[str, Any]]:
        """Records one chunk of the current leg; returns the chunk to send to the client
        (rewritten), or None to send nothing."""
        if "prompt_token_ids" in chunk and not continuation:
            self.prompt_ids = list(chunk["prompt_token_ids"] or [])
        choices = chunk.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        if not continuation and not self.identity:
            self.identity = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
        if isinstance(choice, dict):
            self._record_choice(choice, continuation)
        usage = chunk.get("usage")
        if isinstance(usage, dict) and not choices:
            if not self.include_usage:
                return None
            self.usage_sent = True
            return self._client_chunk({"choices": [], "usage": self._usage(usage)}, continuation)
        if choice is None:
            return None if continuation else self._strip(chunk)
        if continuation:
            return self._client_chunk({"choices": [self._client_choice(choice)]}, True)
        return self._strip(chunk)

    def _record_choice(self, choice: dict[str, Any], continuation: bool) -> None:
        """Token ids whose text reached the client are committed; those whose text is held
        back (an incomplete character, a possible stop string) stay pending until text or
        the finish comes."""
        if not continuation and "prompt_token_ids" in choice:
            self.prompt_ids = list(choice["prompt_token_ids"] or [])
        ids = choice.get("token_ids") or []
        text = (
            choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        )
        if text:
            self.committed += self.pending + list(ids)
            self.pending = []
        else:
            self.pending += list(ids)
        if choice.get("finish_reason") is not None:
            self.finished = True
            self.committed += self.pending
            self.pending = []

    def _strip(self, chunk: dict[str, Any]) -> dict[str, Any]:
        if self.client_wants_ids:
            return chunk
        chunk.pop("prompt_token_ids", None)
        for choice in chunk.get("choices") or []:
            if isinstance(choice, dict):
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
        return chunk

    def _client_choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        """A continuation's completion choice in the client's shape."""
        text = choice.get("text") or ""
        reason = choice.get("finish_reason")
        stop_reason = choice.get("stop_reason")
        if self.chat:
            out = {
                "index": 0,
                "delta": {"content": text} if text or reason is None else {},
                "logprobs": None,
                "finish_reason": reason,
            }
            if reason is not None:  # as the engine's chat stream: in the last chunk only
                out["stop_reason"] = stop_reason
        else:
            out = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": stop_reason,
            }
        if self.client_wants_ids:
            out["token_ids"] = choice.get("token_ids") or []
        return out

    def _client_chunk(self, fields: dict[str, Any], continuation: bool) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return (
            {**self.identity, "object": obj, **fields} if continuation or self.identity else fields
        )

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """Usage of the whole request: the original prompt, every token generated."""
        prompt = (
            len(self.prompt_ids)
            if self.prompt_ids is not None
            else int(usage.get("prompt_tokens") or 0)
        )
        completion = self.base_committed + int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details")
        cached = int((details.get("cached_tokens") or 0) if isinstance(details, dict) else 0)
        cached = min(max(cached - self.base_committed, 0), prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # ------------------------------------------------------------------ continuing
    def remaining(self) -> int:
        return self.max_tokens - len(self.committed)

    def can_continue(self) -> bool:
        return self.prompt_ids is not None and not self.finished and self.remaining() > 0

    def continuation(self) -> dict[str, Any]:
        """The /v1/completions body that goes on from what the client has (only when
        can_continue())."""
        if self.prompt_ids is None:
            raise RuntimeError("no continuation without the prompt's token ids")
        self.pending = []
        self.base_committed = len(self.committed)
        self.legs += 1
        body = {k: v for k, v in self.body.items() if k not in _NOT_CONTINUED}
        guided = guided_fields(self.body)
        if guided:
            body.update(guided)
            body[GUIDED_PREFIX] = list(self.committed)
        body["prompt"] = list(self.prompt_ids) + list(self.committed)
        body["max_tokens"] = self.remaining()
        if isinstance(body.get("min_tokens"), int):
            body["min_tokens"] = max(body["min_tokens"] - len(self.committed), 0)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        body[TOKEN_IDS] = True
        return body

    def final_events(self) -> list[dict[str, Any]]:
        """What a client still needs when the stream can end here (a finish reason was
        sent but the tail broke): the usage chunk it asked for."""
        if self.include_usage and not self.usage_sent:
            n = len(self.committed)
            prompt = len(self.prompt_ids or [])
            return [
                {
                    **self.identity,
                    "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "choices": [],
                    "usage": {
                        "prompt_tokens": prompt,
                        "completion_tokens": n,
                        "total_tokens": prompt + n,
                    },
                }
            ]
        return []
