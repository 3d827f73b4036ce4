"""Sampling parameters of one request, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

from pdpool.engine.bad_words import MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS
from pdpool.engine.structured.spec import GuidedSpec
from pdpool.protocol import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    SEED_MAX,
    SEED_MIN,
)

# As vLLM's --max-logprobs default: at most 20 top logprobs per token.
MAX_LOGPROBS = 20
# logit_bias entries per request, as OpenAI's cap (each is added to the logits every step).
MAX_LOGIT_BIAS = 300
# Choices per prompt: the server fans n out into n engine requests.
MAX_N = 16


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """An int or float that is not a bool, nor NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _check_token_ids(name: str, ids: list, most: int, vocab_size: Optional[int]) -> None:
    """At most `most` ids, each an int in the vocabulary (when its size is known)."""
    if len(ids) > most:
        raise ValueError(f"{name}: at most {most} token ids")
    for t in ids:
        if not _is_integer(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
            raise ValueError(
                f"{name} must be token ids in [0, {vocab_size or 'vocab size'}), got {t!r}"
            )


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
    # vLLM's: the stop string (or stop token's text) that ended the output stays in its text.
    include_stop_str_in_output: bool = False
    n: int = 1
    # None: no logprobs; k >= 0: the sampled token's logprob and the k most likely.
    logprobs: Optional[int] = None
    # None: none; k >= 0: each prompt token's logprob (from the first on) and the k most
    # likely there. Every prompt row is computed for them: no prefix-cache hit is used.
    prompt_logprobs: Optional[int] = None
    # Structured output (guided decoding): what the output must match.
    guided: Optional[GuidedSpec] = None
    # OpenAI's logit_bias: {token id: bias in [-100, 100]} added to the logits.
    logit_bias: Optional[dict[int, float]] = None
    # vLLM's penalties (penalties.py): presence and frequency of output tokens, in [-2, 2];
    # repetition (> 0, 1: none) of prompt and output tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Sampled rows only: tokens below min_p times the likeliest token's probability are out.
    min_p: float = 0.0
    # vLLM's: the only tokens the output may hold (None: any).
    allowed_token_ids: Optional[list[int]] = None
    # vLLM's: the output text leaves out the tokenizer's special tokens (ids stay).
    skip_special_tokens: bool = True
    # vLLM's bad_words as token sequences (bad_words.py): none may end the output.
    bad_words_token_ids: Optional[list[list[int]]] = None

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: Optional[int] = None) -> None:
        """Raises ValueError naming the offending field. The ranges are the HTTP API's
        (pdpool.protocol), so that direct engine users are held to the same; token ids are
        checked against `vocab_size` when given."""
        self._check_types()
        if self.temperature != 0 and not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, "
                f"{MAX_TEMPERATURE}], got {self.temperature}"
            )
        self._check_stop_token_ids(vocab_size)
        self._check_allowed_token_ids(vocab_size)
        self._check_bad_words(vocab_size)
        self._check_logit_bias(vocab_size)
        self._check_ranges()
        self._check_stop()

    def _check_types(self) -> None:
        for name in ("max_tokens", "top_k", "min_tokens", "n"):
            value = getattr(self, name)
            if not _is_integer(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        include = self.include_stop_str_in_output
        if not isinstance(include, bool):
            raise ValueError(f"include_stop_str_in_output must be a boolean, got {include!r}")
        for name in (
            "temperature",
            "top_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "min_p",
        ):
            value = getattr(self, name)
            if not _is_number(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.seed is not None and (
            not _is_integer(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise ValueError(
                f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}"
            )

    def _check_stop_token_ids(self, vocab_size: Optional[int]) -> None:
        _check_token_ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS, vocab_size)

    def _check_allowed_token_ids(self, vocab_size: Optional[int]) -> None:
        ids = self.allowed_token_ids
        if ids is None:
            return
        if not isinstance(ids, list) or not ids:
            raise ValueError("allowed_token_ids must be a non-empty list of token ids")
        _check_token_ids("allowed_token_ids", ids, MAX_ALLOWED_TOKEN_IDS, vocab_size)

    def _check_bad_words(self, vocab_size: Optional[int]) -> None:
        sequences = self.bad_words_token_ids
        if sequences is None:
            return
        if not isinstance(sequences, list) or len(sequences) > MAX_BAD_WORD_SEQUENCES:
            raise ValueError(
                f"bad_words: at most {MAX_BAD_WORD_SEQUENCES} token sequences after tokenization"
            )
        for seq in sequences:
            if not isinstance(seq, list) or not seq:
                raise ValueError("bad_words: every entry must tokenize to at least one token")
            _check_token_ids("bad_words", seq, MAX_BAD_WORD_TOKENS, vocab_size)

    def _check_logit_bias(self, vocab_size: Optional[int]) -> None:
        if len(self.logit_bias or ()) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} token ids")
        for t, bias in (self.logit_bias or {}).items():
            if not _is_integer(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise ValueError(
                    f"logit_bias: token ids must be in [0, {vocab_size or 'vocab size'}), got {t!r}"
                )
            if not _is_number(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias: biases must be in [-100, 100], got {bias!r}")

    def _check_ranges(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"logprobs must be in [0, {MAX_LOGPROBS}] (the maximum allowed "
                f"is {MAX_LOGPROBS}), got {self.logprobs}"
            )
        k = self.prompt_logprobs
        if k is not None and (not _is_integer(k) or not 0 <= k <= MAX_LOGPROBS):
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] (the maximum allowed "
                f"is {MAX_LOGPROBS}), got {k!r}"
            )
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
        self._check_penalties()

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    def _check_stop(self) -> None:
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of them")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings")


def offending_field(error: ValueError) -> Optional[str]:
    """The request field that an error of `validate`, or of a request's own sampling
    checks, names: their messages start with it."""
    name = str(error).split(" ", 1)[0].rstrip(":")
    return name if name in _REQUEST_FIELDS else None


# Request fields named as SamplingParams names them, and those it takes in another form.
_REQUEST_FIELDS = frozenset(f.name for f in fields(SamplingParams)) | {"bad_words", "top_logprobs"}
