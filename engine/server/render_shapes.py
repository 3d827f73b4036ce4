"""vLLM's Renderer API shapes, as pure functions (no I/O; renderer.py serves them).

    /v1/completions/render, /v1/chat/completions/render -> GenerateRequest (a list of them for
        completions: one per prompt): {request_id, token_ids, sampling_params, model, stream,
        ...}, with `sampling_params` as vLLM serializes its SamplingParams (msgspec, defaults
        omitted) for the same body.
    /inference/v1/generate: GenerateRequest in; GenerateTokensResponse out (or its SSE chunks).

Field names, order and presence follow vLLM 0.32's entrypoints/scale_out (the cached venv's
source); tests/vllm compares the render answers with `vllm launch render` field for field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from pdpool.engine.outputs import RequestOutput
from pdpool.engine.server.protocol import ChatCompletionRequest, GenerationRequest
from pdpool.protocol import RequestError

# vLLM's SamplingParams defaults that its serialization omits (msgspec omit_defaults).
VLLM_DEFAULT_MAX_TOKENS = 16
# vLLM's RequestOutputKind: a stream gets deltas, a whole answer its final output only.
OUTPUT_KIND_DELTA, OUTPUT_KIND_FINAL_ONLY = 1, 2
# Below this temperature vLLM samples greedily and drops top_p, top_k and min_p.
GREEDY_EPS = 1e-5


def vllm_sampling_params(
    req: GenerationRequest,
    max_tokens: int,
    logprobs: Optional[int],
    kv_transfer_params: Optional[dict[str, Any]],
    prompt_logprobs: Optional[int] = None,
) -> dict[str, Any]:
    """vLLM's serialized SamplingParams for a request: what its to_sampling_params sets,
    without the fields still at their defaults (vLLM always writes the penalties, the
    temperature, the stop lists and a few internal flags). A chat that offers tools keeps
    special tokens in its text, as vLLM's Hermes tool parser (Qwen3's) asks, to find the
    <tool_call> blocks."""
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    out: dict[str, Any] = {} if req.n == 1 else {"n": req.n}
    out.update(
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
        temperature=temperature,
    )
    if temperature >= GREEDY_EPS:
        out["top_p"] = 1.0 if req.top_p is None else float(req.top_p)
        if req.top_k not in (None, 0):
            out["top_k"] = req.top_k
        out["min_p"] = float(req.min_p or 0.0)
    if req.seed is not None:
        out["seed"] = req.seed
    out["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    out["stop_token_ids"] = list(req.stop_token_ids or [])
    optional = {
        "ignore_eos": (req.ignore_eos, False),
        "include_stop_str_in_output": (req.include_stop_str_in_output, False),
        "max_tokens": (max_tokens, VLLM_DEFAULT_MAX_TOKENS),
        "min_tokens": (req.min_tokens, 0),
        "logprobs": (logprobs, None),
        "prompt_logprobs": (prompt_logprobs, None),
        "allowed_token_ids": (req.allowed_token_ids, None),
    }
    out.update({name: value for name, (value, default) in optional.items() if value != default})
    if offers_tools(req.model_extra or {}) or not req.skip_special_tokens:
        out["skip_special_tokens"] = False
    out["output_kind"] = OUTPUT_KIND_DELTA if req.stream else OUTPUT_KIND_FINAL_ONLY
    out["skip_clone"] = True
    if kv_transfer_params is not None:
        out["extra_args"] = {"kv_transfer_params": kv_transfer_params}
    out["bad_words"] = list(dict.fromkeys(req.bad_words or []))  # deduplicated, as vLLM
    # vLLM's default: a prompt whose logprobs are asked is computed whole
    out["skip_reading_prefix_cache"] = prompt_logprobs is not None
    return out


def _is_unset(value: Any) -> bool:
    return value is None or value == [] or value == {}


# Request fields that change vLLM's sampling_params in ways this shape does not carry
# (structured outputs, logit bias, forced tool calls): a render asking for them is refused
# rather than answered without them. Their neutral values pass.
UNRENDERED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "response_format": lambda v: v is None or v == {"type": "text"},
    "structured_outputs": _is_unset,
    "guided_json": _is_unset,
    "guided_regex": _is_unset,
    "guided_choice": _is_unset,
    "guided_grammar": _is_unset,
    "logit_bias": _is_unset,
    "tool_choice": lambda v: v in (None, "none", "auto"),
}


def unrendered_field(extras: dict[str, Any]) -> Optional[str]:
    """The first field of a request (its extras) that a render cannot carry, if any."""
    return next(
        (name for name, neutral in UNRENDERED_FIELDS.items() if not neutral(extras.get(name))),
        None,
    )


def offers_tools(extras: dict[str, Any]) -> bool:
    """Whether a request offers the model tools it may call (tool_choice not "none")."""
    return bool(extras.get("tools")) and extras.get("tool_choice") != "none"


def render_request_id(
    req: GenerationRequest, header_id: Optional[str], body_id: Optional[str], default: str
) -> str:
    """vLLM's id of a rendered request: the X-Request-Id header, else the body's request_id,
    else a fresh one, after `cmpl-` or `chatcmpl-`."""
    prefix = "chatcmpl" if isinstance(req, ChatCompletionRequest) else "cmpl"
    return f"{prefix}-{header_id or body_id or default}"


def generate_request(
    request_id: str,
    token_ids: list[int],
    sampling_params: dict[str, Any],
    req: GenerationRequest,
) -> dict[str, Any]:
    """One rendered prompt as vLLM's GenerateRequest: what /inference/v1/generate takes."""
    options = req.stream_options
    stream_options = (
        {
            "include_usage": options.include_usage,
            "continuous_usage_stats": options.continuous_usage_stats,
        }
        if req.stream and options is not None
        else None
    )
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": sampling_params,
        "model": req.model,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": bool(req.stream),
        "stream_options": stream_options,
        "cache_salt": req.cache_salt,
        "priority": 0,
        # vLLM's render carries them in sampling_params.extra_args, not here.
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def rendered_ids(request_id: str, count: int) -> list[str]:
    """The ids of a completion's rendered prompts: the id itself for one, `-i` for a batch."""
    return [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]


# --- /inference/v1/generate ------------------------------------------------------------------

# vLLM sampling parameters that become our completion fields of the same name (the validation
# of /v1/completions then applies: ranges, and the unsupported ones refused by name).
PASSED_SAMPLING_PARAMS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "allowed_token_ids",
    "bad_words",
    "include_stop_str_in_output",
    "logprobs",
    "prompt_logprobs",
)
# Settings of how vLLM delivers or detokenizes an output: no effect on the tokens.
IGNORED_SAMPLING_PARAMS = frozenset(
    {
        "output_kind",
        "skip_clone",
        "skip_reading_prefix_cache",
        "detokenize",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "flat_logprobs",
        "stream_interval",
        "watermarking",
        "extra_args",
    }
)
# GenerateRequest fields that must be absent (null): what this engine does not serve.
REFUSED_GENERATE_FIELDS = ("features", "content_parts", "ec_transfer_params")


def _sampling_fields(params: Any) -> dict[str, Any]:
    if not isinstance(params, dict):
        raise RequestError("'sampling_params' (an object) is required", "sampling_params")
    fields = {name: params[name] for name in PASSED_SAMPLING_PARAMS if name in params}
    for name, value in params.items():
        if name not in fields and name not in IGNORED_SAMPLING_PARAMS and not _is_unset(value):
            raise RequestError(
                f"'sampling_params.{name}' is not supported by this server", "sampling_params"
            )
    return fields


def _kv_transfer_params(body: dict[str, Any]) -> Any:
    """The request's kv_transfer_params: at the top, or where vLLM's render puts them."""
    if body.get("kv_transfer_params") is not None:
        return body["kv_transfer_params"]
    extra = body["sampling_params"].get("extra_args")
    return extra.get("kv_transfer_params") if isinstance(extra, dict) else None


def completion_body(body: Any, default_max_tokens: int) -> dict[str, Any]:
    """A GenerateRequest body as the equivalent /v1/completions body (token ids as the
    prompt), to be validated as one. `default_max_tokens` stands in for an absent or null
    max_tokens (vLLM: what the context leaves). Raises RequestError."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    token_ids = body.get("token_ids")
    if (
        not isinstance(token_ids, list)
        or not token_ids
        or not all(type(t) is int and t >= 0 for t in token_ids)
    ):
        raise RequestError("'token_ids' (a non-empty list of token ids) is required", "token_ids")
    if body.get("output_mode", "tokens") != "tokens":
        raise RequestError("only output_mode 'tokens' is supported", "output_mode")
    for name in REFUSED_GENERATE_FIELDS:
        if not _is_unset(body.get(name)):
            raise RequestError(f"'{name}' is not supported by this server", name)
    fields = _sampling_fields(body.get("sampling_params"))
    if fields.get("max_tokens") is None:
        fields["max_tokens"] = default_max_tokens
    if body.get("stream"):
        # vLLM's stream has no place for them (it computes them and sends none)
        fields.pop("prompt_logprobs", None)
    out = {
        **fields,
        "prompt": token_ids,
        "stream": body.get("stream") or False,
        "kv_transfer_params": _kv_transfer_params(body),
    }
    for name in ("model", "stream_options", "cache_salt", "priority"):
        if body.get(name) is not None:
            out[name] = body[name]
    return out


def generate_usage(
    prompt_tokens: int, completion_tokens: int, cached: int, compact: bool = False
) -> dict[str, Any]:
    """vLLM's UsageInfo as vLLM serves it with --enable-prompt-tokens-details; `compact`
    leaves out the null fields, as vLLM's closing usage chunk of a stream does."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if not compact:
        usage["prompt_tokens_details"].update(created_cache_tokens=None, multimodal_tokens=None)
        usage["completion_tokens_details"] = None
    return usage


def generate_choice(
    index: int,
    finish_reason: Optional[str],
    token_ids: list[int],
    stream: bool,
    stop_reason: Union[int, str, None] = None,
    logprobs: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """One choice of GenerateTokensResponse (stream: of a chunk); stop_reason: the stop
    string or token id that ended it; logprobs: its tokens' GenerateLogProbs, when asked."""
    return {
        "index": index,
        # vLLM: a whole answer's choice always has a finish_reason, a chunk's only at its end
        "finish_reason": finish_reason if stream else (finish_reason or "stop"),
        "stop_reason": stop_reason,
        "token_ids": token_ids,
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": None,
        "logprobs": logprobs,
    }


@dataclass(frozen=True)
class GenerateFinal:
    """One choice of a whole generate answer."""

    index: int
    last: RequestOutput  # its last output
    token_ids: list[int]  # all of them
    logprobs: Optional[dict[str, Any]]  # its tokens' GenerateLogProbs, when asked


def generate_response(
    request_id: str,
    model: str,
    created: int,
    prompt_ids: list[int],
    return_token_ids: bool,
    finals: list[GenerateFinal],
    prompt_logprobs: Optional[list[Optional[dict[str, Any]]]] = None,
) -> dict[str, Any]:
    """A whole GenerateTokensResponse: its choices, and vLLM's `prompt_logprobs` when
    asked."""
    first = finals[0].last
    return {
        "request_id": request_id,
        "model": model,
        "created": created,
        "usage": generate_usage(
            len(prompt_ids), sum(len(f.token_ids) for f in finals), first.num_cached_tokens
        ),
        "prompt_logprobs": prompt_logprobs,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": prompt_ids if return_token_ids else None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": first.kv_transfer_params if len(finals) == 1 else None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [
            generate_choice(
                f.index,
                f.last.finish_reason,
                f.token_ids,
                stream=False,
                stop_reason=f.last.stop_reason,
                logprobs=f.logprobs,
            )
            for f in finals
        ],
    }


def generate_chunk(
    request_id: str,
    choice: dict[str, Any],
    usage: Optional[dict[str, Any]] = None,
    prompt_ids: Optional[list[int]] = None,
) -> dict[str, Any]:
    """One SSE chunk of a streamed GenerateTokensResponse: one choice's new tokens (the
    prompt ids on the first, when asked), or with no choice the closing usage."""
    chunk: dict[str, Any] = {"request_id": request_id, "usage": usage}
    if prompt_ids is not None:
        chunk["prompt_token_ids"] = prompt_ids
    chunk["output_mode"] = "tokens"
    chunk["choices"] = [choice] if choice else []
    return chunk
