"""The one place P/D is decided: whether a request's prompt is computed on a prefill engine
first, or left to its decode engine.

Two deciders, for the two moments a decision can be made:
- up front, in the gateway or the EPP, from the KV index (`PrefixHitDecider`): the chosen
  decode engine's predicted hit ratio (cached / prompt tokens, offload-tier tokens counted
  as cached, as the engine counts them) below the pool's threshold means "pd", else
  "decode"; the router tells the sidecar in `PD_HEADER`.
- in the decode pod's sidecar, for decode-first (`DecodeFirstDecider`): a router's "pd"
  is honoured; an engine that can reject (`cache_hit_threshold`) is asked and decides from
  its own cache; for one that cannot (stock vLLM) the prompt's estimated length decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Optional

PD_HEADER = "x-pdpool-kv-path"  # "pd": skip decode-first; "decode": decode-first

# llm-d's scheduler estimates prompt tokens from characters the same way (4 per token).
CHARS_PER_TOKEN = 4

Path = Literal["pd", "decode"]
# What the sidecar does next in decode-first: "pd" (prefill remotely now), "decode" (the
# decode engine alone, no threshold), "ask_decode" (decode with the threshold: the engine
# decides, and a rejection is a "pd").
Step = Literal["pd", "decode", "ask_decode"]


@dataclass(frozen=True)
class PrefixHitDecider:
    threshold: float

    def decide(self, hit_tokens: int, prompt_tokens: int) -> Path:
        if prompt_tokens and hit_tokens / prompt_tokens < self.threshold:
            return "pd"
        return "decode"


@dataclass(frozen=True)
class DecodeFirstStep:
    step: Step
    by: Literal["router", "length", "engine"]


@dataclass(frozen=True)
class DecodeFirstDecider:
    min_prompt_tokens: int  # for an engine that cannot reject

    def decide(
        self, hint: Optional[str], engine_rejects: Optional[bool], body: dict[str, Any]
    ) -> DecodeFirstStep:
        """`hint`: the router's PD_HEADER; `engine_rejects`: what is known of the decode
        engine (None: not yet, then it is asked as one that rejects)."""
        if hint == "pd":
            return DecodeFirstStep("pd", "router")
        if engine_rejects is False:
            long_prompt = estimate_prompt_tokens(body) >= self.min_prompt_tokens
            return DecodeFirstStep("pd" if long_prompt else "decode", "length")
        return DecodeFirstStep("ask_decode", "engine")


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
