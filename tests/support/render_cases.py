"""Request bodies for the Renderer API tests (tests/engine/test_render_api.py against our
completion routes, tests/vllm/test_vllm_render.py against `vllm launch render`): every
template and add_special_tokens case the engine tokenizes differently."""

from __future__ import annotations

from typing import Any

COMPLETION = "/v1/completions/render"
CHAT = "/v1/chat/completions/render"

SYSTEM = {"role": "system", "content": "You are terse."}
TURNS = [
    {"role": "user", "content": "What is a cat?"},
    {"role": "assistant", "content": "A small animal."},
    {"role": "user", "content": "And a dog?"},
]

# (id, route, body). Chats name max_tokens: vLLM's chat default is the context's room, ours
# the completion default of 16 (docs/engine.md).
RENDER_CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("text", COMPLETION, {"prompt": "The quick brown fox"}),
    ("text-no-special", COMPLETION, {"prompt": "The quick brown fox", "add_special_tokens": False}),
    ("batch", COMPLETION, {"prompt": ["one prompt", "and another one"], "max_tokens": 3}),
    ("token-ids", COMPLETION, {"prompt": [5, 6, 7, 8]}),
    (
        "sampling",
        COMPLETION,
        {
            "prompt": "Sampling",
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 5,
            "seed": 11,
            "n": 2,
            "stop": "x",
            "stop_token_ids": [3],
            "max_tokens": 7,
            "min_tokens": 1,
            "logprobs": 2,
            "ignore_eos": True,
        },
    ),
    (
        "greedy-stream",
        COMPLETION,
        {
            "prompt": "Greedy",
            "temperature": 0,
            "top_k": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "cache_salt": "salt",
        },
    ),
    ("user", CHAT, {"messages": [TURNS[0]], "max_tokens": 8}),
    ("system", CHAT, {"messages": [SYSTEM, TURNS[0]], "max_tokens": 8}),
    ("multi-turn", CHAT, {"messages": [SYSTEM, *TURNS], "max_tokens": 8}),
    (
        "no-generation-prompt",
        CHAT,
        {"messages": [SYSTEM, *TURNS], "add_generation_prompt": False, "max_tokens": 8},
    ),
    (
        "chat-special-tokens",
        CHAT,
        {"messages": [SYSTEM, TURNS[0]], "add_special_tokens": True, "max_tokens": 8},
    ),
    (
        "continue-final",
        CHAT,
        {
            "messages": [*TURNS[:2]],
            "add_generation_prompt": False,
            "continue_final_message": True,
            "max_tokens": 8,
        },
    ),
    (
        "content-parts",
        CHAT,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "two"}],
                }
            ],
            "max_tokens": 8,
        },
    ),
    (
        "tools",
        CHAT,
        {
            "messages": [SYSTEM, TURNS[0]],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "lookup",
                        "description": "Look a word up.",
                        "parameters": {
                            "type": "object",
                            "properties": {"word": {"type": "string"}},
                            "required": ["word"],
                        },
                    },
                }
            ],
            "tool_choice": "auto",
            "max_tokens": 8,
        },
    ),
    (
        "chat-sampling",
        CHAT,
        {
            "messages": [TURNS[0]],
            "max_completion_tokens": 9,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
        },
    ),
    # the prompt's logprobs: asked, or by completions' echo with logprobs
    ("prompt-logprobs", COMPLETION, {"prompt": "Scored", "prompt_logprobs": 3, "max_tokens": 2}),
    ("echo-logprobs", COMPLETION, {"prompt": "Echoed", "echo": True, "logprobs": 1}),
    (
        "chat-prompt-logprobs",
        CHAT,
        {"messages": [TURNS[0]], "prompt_logprobs": 0, "stream": True, "max_tokens": 4},
    ),
]
