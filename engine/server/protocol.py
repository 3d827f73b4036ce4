"""OpenAI request bodies (with vLLM's extensions) and their conversion to engine terms."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union, cast

from pydantic import PrivateAttr

from pdpool.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from pdpool.protocol import ChatFields, ChatMessageFields, CompletionFields, KVTransferParams

if TYPE_CHECKING:
    from pdpool.protocol import _GenerationFields as _MixedInto
else:
    _MixedInto = object  # at run time a plain mixin: pydantic sees the models' fields only

# The fields, their strict types and ranges are defined once in pdpool.protocol (shared with
# the sidecar and the gateway); validate bodies with pdpool.protocol.validate_request. Here:
# the conversion to engine terms. vLLM's extensions among those fields: `return_token_ids`
# (token ids in the answer; the gateway uses them to migrate a broken stream) and
# `return_tokens_as_token_ids` (logprob tokens as "token_id:<id>").


class _SamplingFields(_MixedInto):
    """Conversion to engine terms, mixed into the shared request models."""

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self._max_tokens()
        params = SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            min_tokens=self.min_tokens,
            n=self.n,
            logprobs=self._logprobs(),
            prompt_logprobs=self.asked_prompt_logprobs(),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            allowed_token_ids=self.allowed_token_ids,
            skip_special_tokens=self.skip_special_tokens,
        )
        params.validate()
        return params

    def _max_tokens(self) -> Optional[int]:
        return self.max_tokens

    def _logprobs(self) -> Optional[int]:
        """How many top logprobs per token (None: no logprobs at all)."""
        return None

    def asked_prompt_logprobs(self) -> Optional[int]:
        return self.prompt_logprobs

    def kv_params_dict(self) -> Optional[dict[str, Any]]:
        # Both request models below parse the shared models' raw object as KVTransferParams.
        params = cast(Optional[KVTransferParams], self.kv_transfer_params)
        return params.to_wire() if params else None


class CompletionRequest(_SamplingFields, CompletionFields):
    # pydantic parses it (the shared models keep the raw object): a narrower field type.
    kv_transfer_params: Optional[KVTransferParams] = None  # type: ignore[assignment]
    # bad_words as token sequences, tokenized with the body, off the event loop (translator).
    _bad_words_ids: Optional[list[list[int]]] = PrivateAttr(default=None)
    # As vLLM: `logprobs` is the sampled token's logprob plus the `logprobs` most likely.

    def _logprobs(self) -> Optional[int]:
        return self.logprobs

    def asked_prompt_logprobs(self) -> Optional[int]:
        # As vLLM: an echoed prompt's logprobs come with the answer's.
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs
        return self.prompt_logprobs

    def _max_tokens(self) -> Optional[int]:
        # As vLLM: echo with max_tokens 0 makes one token, which the answer leaves out.
        return 1 if self.echo and self.max_tokens == 0 else self.max_tokens

    def prompt_inputs(self) -> list[Union[str, list[int]]]:
        """The prompts of the request: one, or a batch (a list of strings or of token-id
        lists); each gets n choices."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [cast(Union[str, list[int]], p)]  # not a batch: one string or token-id list


def message_text(message: ChatMessageFields) -> str:
    """A chat message's text (content parts are text only: pdpool.protocol checks that),
    parts joined by newlines as vLLM joins them for a string-content chat template."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "\n".join(part.text for part in message.content)


class ChatCompletionRequest(_SamplingFields, ChatFields):
    # pydantic parses it (the shared models keep the raw object): a narrower field type.
    kv_transfer_params: Optional[KVTransferParams] = None  # type: ignore[assignment]
    _bad_words_ids: Optional[list[list[int]]] = PrivateAttr(default=None)  # as above

    def _logprobs(self) -> Optional[int]:
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"top_logprobs must be in [0, {MAX_LOGPROBS}] (the maximum "
                    f"allowed is {MAX_LOGPROBS}), got {self.top_logprobs}"
                )
            if self.top_logprobs > 0 and not self.logprobs:  # 0 asks for nothing (vLLM)
                raise ValueError(
                    "top_logprobs: when using top_logprobs, logprobs must be set to true"
                )
        return (self.top_logprobs or 0) if self.logprobs else None

    def _max_tokens(self) -> Optional[int]:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


# A generation endpoint's request.
GenerationRequest = Union[CompletionRequest, ChatCompletionRequest]


def client_request_id(http_req: Any, req: GenerationRequest) -> Optional[str]:
    """The id the client gave its request: the X-Request-Id header, else the body's
    request_id (vLLM's order)."""
    return http_req.headers.get("x-request-id") or req.request_id


def usage_dict(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, pulled_tokens: int = 0
) -> dict[str, Any]:
    """OpenAI usage; `prompt_tokens_details.pdpool` splits the prompt by where its KV came
    from: this engine's prefix cache (local), a peer (pulled), or the model (computed)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": cached_tokens,
            "pdpool": {
                "local": cached_tokens - pulled_tokens,
                "pulled": pulled_tokens,
                "computed": prompt_tokens - cached_tokens,
            },
        },
    }


def error_body(
    message: str, err_type: str = "BadRequestError", code: int = 400, param: Optional[str] = None
) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": err_type, "param": param, "code": code},
        # vLLM also puts these at the top level; clients read either.
        "object": "error",
        "message": message,
        "type": err_type,
        "code": code,
    }
