"""OpenAI request bodies (with vLLM's extensions) and their conversion to engine terms."""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdpool.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from pdpool.protocol import KVTransferParams, validate_threshold


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    # Unknown fields (user, logit_bias, ...) are ignored as OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    cache_salt: Optional[str] = None
    cache_hit_threshold: Optional[float] = None
    kv_transfer_params: Optional[KVTransferParams] = None
    # vLLM's extension: token ids in the answer (prompt_token_ids in a stream's first
    # chunk, token_ids in every choice); the gateway uses them to migrate a broken stream.
    return_token_ids: bool = False
    # vLLM's extension: logprob tokens as "token_id:<id>" instead of their text.
    return_tokens_as_token_ids: bool = False

    @field_validator("cache_hit_threshold", mode="before")
    @classmethod
    def _threshold(cls, v: Any):
        return validate_threshold(v)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self._max_tokens()
        params = SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, n=self.n,
            logprobs=self._logprobs())
        params.validate()
        return params

    def _max_tokens(self) -> Optional[int]:
        return self.max_tokens

    def _logprobs(self) -> Optional[int]:
        """How many top logprobs per token (None: no logprobs at all)."""
        return None

    def kv_params_dict(self) -> Optional[dict]:
        return self.kv_transfer_params.to_wire() if self.kv_transfer_params else None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    # As vLLM: the sampled token's logprob plus the `logprobs` most likely, per token.
    logprobs: Optional[int] = None

    def _logprobs(self) -> Optional[int]:
        return self.logprobs

    def prompt_inputs(self) -> list[Union[str, list[int]]]:
        """The prompts of the request: one, or a batch (a list of strings or of token-id
        lists); each gets n choices."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"message content of type {part.get('type')!r} is not supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None

    def _logprobs(self) -> Optional[int]:
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}] (the maximum "
                                 f"allowed is {MAX_LOGPROBS}), got {self.top_logprobs}")
            if not self.logprobs:
                raise ValueError("top_logprobs: when using top_logprobs, logprobs must be "
                                 "set to true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def _max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               pulled_tokens: int = 0) -> dict:
    """OpenAI usage; `prompt_tokens_details.pdpool` splits the prompt by where its KV came
    from: this engine's prefix cache (local), a peer (pulled), or the model (computed)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {
                "cached_tokens": cached_tokens,
                "pdpool": {"local": cached_tokens - pulled_tokens, "pulled": pulled_tokens,
                           "computed": prompt_tokens - cached_tokens}}}


def error_body(message: str, err_type: str = "BadRequestError", code: int = 400,
               param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code},
            # vLLM also puts these at the top level; clients read either.
            "object": "error", "message": message, "type": err_type, "code": code}
