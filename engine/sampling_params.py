"""Sampling parameters of one request, validated once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# As vLLM's --max-logprobs default: at most 20 top logprobs per token.
MAX_LOGPROBS = 20
# Choices per prompt: the server fans n out into n engine requests.
MAX_N = 16


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    # None: no logprobs; k >= 0: the sampled token's logprob and the k most likely.
    logprobs: Optional[int] = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Raises ValueError naming the offending field."""
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] (the maximum allowed "
                             f"is {MAX_LOGPROBS}), got {self.logprobs}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of them")
        if len(self.stop) > 8:
            raise ValueError("stop: at most 8 stop strings")
