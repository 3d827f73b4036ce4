"""Wire types shared by the engine and the sidecar.

No heavy imports here: the sidecar and gateway images do not carry torch.
Field names follow vLLM's NixlConnector so that vLLM-based routers work against our engine
and our sidecar works against vLLM.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

# finish_reason of a request rejected because too little of its prompt was cached.
FINISH_CACHE_THRESHOLD = "cache_threshold"


class KVTransferParams(BaseModel):
    """`kv_transfer_params` of a request or response (NixlConnector fields)."""

    model_config = ConfigDict(extra="allow")

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: Optional[str] = None
    remote_request_id: Optional[str] = None
    # One list of block ids, or one list per KV cache group for hybrid models.
    remote_block_ids: Optional[Union[list[int], list[list[int]]]] = None
    remote_host: Optional[str] = None
    remote_port: Optional[int] = None
    tp_size: int = 1
    # Pulls in the other direction (prefill reads a decode engine's cached prefix).
    remote_num_tokens: Optional[int] = None

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


def validate_threshold(value: Any, name: str = "cache_hit_threshold") -> Optional[float]:
    """Returns a threshold in [0, 1] or None; raises ValueError with a readable message."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number in [0, 1], got {type(value).__name__}")
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return float(value)


# --------------------------------------------------------------------------------------
# Request bodies: one definition of what the engine, the sidecar and the gateway accept.
#
# Types are OpenAI's, strictly: booleans are booleans, integers are integers (not booleans,
# not strings), strings are strings. Ranges are checked here as far as they do not depend on
# the model (token ids against the vocabulary are the engine's check). Fields this project
# does not implement are refused by name instead of being silently ignored; other unknown
# fields (`user`, `metadata`, ...) are ignored as OpenAI-compatible servers do.

# Request bodies above this size are refused with 413 (every server; a flag changes it).
# A 10 MB prompt fits even with JSON escaping of a few characters.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# OpenAI bodies nest a few levels (messages[].content[].text); 32 is far beyond any.
MAX_JSON_DEPTH = 32
# torch.Generator.manual_seed accepts [-2**63, 2**64 - 1] (as vLLM: whatever it accepts).
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
# vLLM's request `priority` (a signed 64-bit int; lower is served first under
# --scheduling-policy priority, ignored under fcfs).
PRIORITY_MIN, PRIORITY_MAX = -(1 << 63), (1 << 63) - 1
# temperature is 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE]: below 1e-2 (vLLM's
# _MAX_TEMP clamp) logits / temperature overflow float32 and the softmax is not finite.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-2, 2.0
MAX_STOP_STRINGS = 8
# Token-id lists the engine scans every step (a stop check per token, a mask while
# min_tokens holds) or turns into a mask: capped, so that one body cannot slow every step.
MAX_STOP_TOKEN_IDS = 1024
# vLLM's bad_words: a bounded list (repeats count once, and at most 128 token sequences
# after tokenization: engine/bad_words.py), each word of a bounded length (every one is
# tokenized twice per request).
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 1024
MAX_ALLOWED_TOKEN_IDS = 16384
# A client's request id goes into logs and answer ids: visible ASCII only (as a header's).
REQUEST_ID_PATTERN = r"^[!-~]*$"


class RequestError(ValueError):
    """A request body refused with 400 (or `status`); `param` names the offending field."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def parse_json_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Strict JSON: UTF-8 only, no NaN/Infinity, no lone surrogates (from \\ud800 escapes),
    nesting at most `max_depth`. Raises RequestError."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise RequestError(f"the request body nests deeper than {max_depth} levels") from None
    except ValueError as exc:  # JSONDecodeError, huge integers, NaN/Infinity
        msg = (
            f"{exc.msg} (line {exc.lineno} column {exc.colno})"
            if isinstance(exc, json.JSONDecodeError)
            else str(exc)
        )
        raise RequestError(f"the request body is not valid JSON: {msg}") from None
    if isinstance(value, (dict, list)) and _nesting_exceeds(raw, max_depth):
        raise RequestError(f"the request body nests deeper than {max_depth} levels")
    if _SURROGATE_ESCAPE.search(text):
        _find_surrogates(value)
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


_SURROGATE = re.compile("[\ud800-\udfff]")
# Valid UTF-8 cannot carry a surrogate: only a JSON escape (\\uD800-\\uDFFF) can.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
# Brackets kept, objects' made square (nesting is unchanged), everything else deleted.
_SQUARE = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_NOT_OPENING = bytes(b for b in range(256) if b not in b"[{")


def _nesting_exceeds(raw: bytes, max_depth: int) -> bool:
    """Whether valid JSON nests deeper than `max_depth`, at C speed: strip the strings,
    keep the brackets, then peel the innermost empty pairs off, exactly one level per pass
    (bytes.replace does not rescan what it produced). Each level opens with a bracket, so
    a body with no more opening brackets than `max_depth`, strings' included, is answered
    without stripping its strings (the costly part: 90 us for a 15 KB prompt, against 6 to
    count)."""
    if len(raw.translate(None, _NOT_OPENING)) <= max_depth:
        return False
    brackets = _JSON_STRING.sub(b"", raw).translate(_SQUARE, _NOT_BRACKETS)
    for _ in range(max_depth):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")
    return bool(brackets)


def _find_surrogates(value: Any) -> None:
    """Raises RequestError for a lone surrogate in any string or key (iteratively: a
    hostile body must not exhaust the stack)."""
    stack = [(value, None)]
    while stack:
        v, top = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise RequestError("a string holds a lone surrogate (invalid Unicode)", top)
        elif isinstance(v, dict):
            for k, item in v.items():
                if _SURROGATE.search(k):
                    raise RequestError("a key holds a lone surrogate (invalid Unicode)", top)
                stack.append((item, k if top is None else top))
        elif isinstance(v, list):
            stack.extend((item, top) for item in v if isinstance(item, (str, dict, list)))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _empty(v: Any) -> bool:
    return v is None or v is False or v == "" or v == [] or v == {}


def _none_or_number(neutral: float) -> Callable[[Any], bool]:
    """Absent, or the number that asks for nothing (a penalty of 0, a factor of 1)."""
    return lambda v: v is None or ((_is_int(v) or isinstance(v, float)) and v == neutral)


# Fields we do not implement: refused unless their value asks for nothing (the predicate).
# Structured outputs, tools and logit_bias are implemented: they ride the models' extras
# (checked by the engine server, forwarded as they are by the sidecar and the gateway).
UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v is None or (_is_int(v) and v == 1),
    "functions": _empty,
    "function_call": lambda v: v is None or v == "none",
    "suffix": _empty,
    "use_beam_search": _empty,
    "length_penalty": _none_or_number(1),
    "structural_tag": _empty,
    "prompt_embeds": _empty,
    "audio": _empty,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": _empty,
    "chat_template": _empty,
    "documents": _empty,
    # vLLM answers these with more than we compute: refused rather than silently dropped.
    "logprob_token_ids": _empty,
    "return_token_offsets": _empty,
    "return_prompt_text": _empty,
    "repetition_detection": _empty,
    "watermarking": _empty,
}

# Strict scalar types of OpenAI's schema.
Int = StrictInt
Bool = StrictBool
Str = StrictStr
Number = Annotated[StrictFloat, Field(allow_inf_nan=False)]  # an int is accepted too
TokenId = Annotated[StrictInt, Field(ge=0)]


class StreamOptionsFields(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: Bool = False
    continuous_usage_stats: Bool = False


class _GenerationFields(BaseModel):
    """Fields both generation routes share (OpenAI's plus vLLM's extensions)."""

    model_config = ConfigDict(extra="allow")

    model: Optional[Str] = None
    max_tokens: Optional[Annotated[Int, Field(ge=0)]] = None  # 0: completions' echo only
    temperature: Optional[Number] = None
    top_p: Optional[Annotated[Number, Field(gt=0.0, le=1.0)]] = None
    top_k: Optional[Annotated[Int, Field(ge=-1)]] = None  # -1 or 0: disabled
    seed: Optional[Annotated[Int, Field(ge=SEED_MIN, le=SEED_MAX)]] = None
    stop: Optional[Union[Str, list[Str]]] = None
    stop_token_ids: Optional[Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]] = None
    ignore_eos: Bool = False
    include_stop_str_in_output: Bool = False
    min_tokens: Annotated[Int, Field(ge=0)] = 0
    n: Annotated[Int, Field(ge=1)] = 1
    stream: Optional[Bool] = False
    stream_options: Optional[StreamOptionsFields] = None
    user: Optional[Str] = None
    cache_salt: Optional[Str] = None
    cache_hit_threshold: Optional[Number] = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    return_token_ids: Optional[Bool] = False
    return_tokens_as_token_ids: Optional[Bool] = False
    priority: Annotated[Int, Field(ge=PRIORITY_MIN, le=PRIORITY_MAX)] = 0
    presence_penalty: Optional[Annotated[Number, Field(ge=-2.0, le=2.0)]] = None
    frequency_penalty: Optional[Annotated[Number, Field(ge=-2.0, le=2.0)]] = None
    repetition_penalty: Optional[Annotated[Number, Field(gt=0.0)]] = None
    min_p: Optional[Annotated[Number, Field(ge=0.0, le=1.0)]] = None
    allowed_token_ids: Optional[
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)]
    ] = None
    bad_words: Optional[
        Annotated[
            list[Annotated[Str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]],
            Field(max_length=MAX_BAD_WORDS),
        ]
    ] = None
    # vLLM's detokenizing options. Ours is always a fast tokenizer, for which vLLM too reads
    # spaces_between_special_tokens nowhere: it is checked and has no effect.
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True
    # vLLM's: the id the answer carries (after an X-Request-Id header), and arguments for
    # custom logits processors (this engine runs none: checked, then unused).
    request_id: Optional[Annotated[Str, Field(max_length=256, pattern=REQUEST_ID_PATTERN)]] = None
    vllm_xargs: Optional[dict[Str, Union[Str, Int, Number, list[Union[Str, Int, Number]]]]] = None
    # Keep only this many prompt tokens (-1: what the context holds); the engine checks it
    # against its context.
    truncate_prompt_tokens: Optional[Annotated[Int, Field(ge=-1)]] = None
    truncation_side: Optional[Literal["left", "right"]] = None
    # vLLM's: each prompt token's logprob (after the first) and this many likeliest there
    # (-1: all, which the engines' logprob limit refuses); whole answers only.
    prompt_logprobs: Optional[Int] = None

    def _limit(self) -> Optional[int]:
        return self.max_tokens


class CompletionFields(_GenerationFields):
    prompt: Union[Str, list[TokenId], list[Str], list[list[TokenId]]]
    logprobs: Optional[Annotated[Int, Field(ge=0)]] = None
    # Each choice's text starts with its prompt's; with max_tokens 0 it is the prompt alone.
    echo: Optional[Bool] = False
    # As vLLM: a text prompt gets the tokenizer's special tokens (a BOS) unless told not to.
    add_special_tokens: Bool = True


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: Str


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Str
    # OpenAI's is a JSON string; an object is read as the arguments themselves.
    arguments: Union[Str, dict[Str, Any]] = "{}"


class ToolCallFields(BaseModel):
    """A tool call of an assistant message in the history."""

    model_config = ConfigDict(extra="allow")
    id: Optional[Str] = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessageFields(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Str
    content: Union[Str, list[ContentPart], None] = None
    name: Optional[Str] = None
    tool_calls: Optional[list[ToolCallFields]] = None
    tool_call_id: Optional[Str] = None


class ChatFields(_GenerationFields):
    messages: Annotated[list[ChatMessageFields], Field(min_length=1)]
    # The answer starts with the last message's text when that message has the answer's
    # role (an assistant message continued, or any last message without a generation prompt).
    echo: Optional[Bool] = False
    max_completion_tokens: Optional[Annotated[Int, Field(ge=1)]] = None
    logprobs: Optional[Bool] = False
    top_logprobs: Optional[Annotated[Int, Field(ge=0)]] = None
    # How the chat template renders the messages, with vLLM's defaults: the template already
    # spells the special tokens, so the tokenizer adds none unless told to.
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    add_special_tokens: Bool = False
    # More variables for the chat template (Qwen3's enable_thinking, for one).
    chat_template_kwargs: Optional[dict[Str, Any]] = None

    def _limit(self) -> Optional[int]:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


ROUTE_MODELS = {"/v1/completions": CompletionFields, "/v1/chat/completions": ChatFields}


def check_unsupported(body: dict, model: Optional[type[_GenerationFields]] = None) -> None:
    for name, harmless in UNSUPPORTED_FIELDS.items():
        if name in body and not harmless(body[name]):
            raise RequestError(f"'{name}' is not supported by this server", name)


def validate_request(body: Any, model: type[_GenerationFields], refuse_unsupported: bool = True):
    """The body as `model` (a subclass of CompletionFields or ChatFields), checked as above;
    raises RequestError naming the first offending field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if refuse_unsupported:
        check_unsupported(body, model)
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        raise RequestError(*_first_error(exc)) from None
    check_ranges(req)
    return req


def check_prompt_logprobs(req: _GenerationFields) -> None:
    k = req.prompt_logprobs
    if k is None:
        return
    if k < -1:
        raise RequestError("prompt_logprobs must be a positive value or -1", "prompt_logprobs")
    if req.stream and k != 0:
        # As vLLM: the prompt's logprobs come in a whole answer only.
        raise RequestError("prompt_logprobs are not available when stream=true", "prompt_logprobs")
    kv = req.kv_transfer_params
    if kv.get("do_remote_prefill") if isinstance(kv, dict) else kv and kv.do_remote_prefill:
        raise RequestError(
            "prompt_logprobs need the prompt computed by the engine that answers, not its "
            "KV loaded from another engine (do_remote_prefill)",
            "prompt_logprobs",
        )


def check_token_limit(req: _GenerationFields) -> None:
    limit = req._limit()
    if limit == 0 and not (isinstance(req, CompletionFields) and req.echo):
        # As vLLM: nothing to generate is an answer only when the prompt is echoed.
        raise RequestError(
            "max_tokens must be at least 1 (0 only with echo: the prompt alone)", "max_tokens"
        )
    if limit == 0:
        limit = 1  # as vLLM: the one token an echo of the prompt alone makes, left out
    if limit is not None and req.min_tokens > limit:
        raise RequestError(
            f"min_tokens ({req.min_tokens}) must not exceed the token limit ({limit})", "min_tokens"
        )


def check_ranges(req: _GenerationFields) -> None:
    """The rules pydantic field types cannot say."""
    t = req.temperature
    if t is not None and t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
        raise RequestError(
            f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {t}",
            "temperature",
        )
    if req.cache_hit_threshold is not None:
        try:
            validate_threshold(req.cache_hit_threshold)
        except ValueError as exc:
            raise RequestError(str(exc), "cache_hit_threshold") from None
    options = req.stream_options
    if options is not None and (options.model_fields_set or options.model_extra) and not req.stream:
        # As OpenAI and vLLM: options of a stream the request does not ask for are a mistake.
        raise RequestError("stream_options can only be given with stream: true", "stream_options")
    check_token_limit(req)
    if req.seed is not None and req.seed + req.n - 1 > SEED_MAX:
        raise RequestError(
            f"seed + n - 1 must be at most {SEED_MAX} (choice i samples with seed + i)", "seed"
        )
    if isinstance(req, ChatFields) and req.add_generation_prompt and req.continue_final_message:
        raise RequestError(
            "continue_final_message and add_generation_prompt cannot both be true "
            "(set add_generation_prompt to false to continue the final message)",
            "continue_final_message",
        )
    check_prompt_logprobs(req)
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise RequestError(f"stop: at most {MAX_STOP_STRINGS} non-empty strings", "stop")


def _first_error(exc: ValidationError) -> tuple[str, Optional[str]]:
    """One readable error: with unions pydantic reports every alternative; the deepest
    error (e.g. `prompt.0` rather than `prompt`) says best what is wrong."""
    errors = exc.errors(include_url=False)
    e = max(errors, key=lambda x: len([p for p in x.get("loc", ()) if not _is_union_tag(p)]))
    where = ".".join(str(x) for x in e.get("loc", ()) if not _is_union_tag(x))
    param = str(e["loc"][0]) if e.get("loc") else None
    msg = e.get("msg", "invalid value")
    return (f"{where}: {msg}" if where else msg), param


def _is_union_tag(x: Any) -> bool:
    # pydantic names the union member it tried, e.g. "str", "list[int]", "constrained-int".
    return isinstance(x, str) and (
        "[" in x
        or x
        in (
            "str",
            "int",
            "float",
            "bool",
            "dict",
            "list",
            "function-after",
            "constrained-int",
            "constrained-float",
            "constrained-str",
        )
    )
