"""The structured-output fields of a request body, read into a GuidedSpec (and logit_bias
into token biases), checked here in the HTTP process: a schema that is not a JSON Schema, a
choice list that is empty, or two kinds at once are a 400 before anything reaches the engine
core (which compiles the spec; what only the compiler can refuse is a 400 from there).
A spec over the caps of structured/limits.py is a 400 naming the cap, found by cheap walks
before anything recurses or compiles. These checks take CPU time: callers run them off the
event loop (responders.py).

The fields are vLLM's: chat `response_format` (`json_object`, `json_schema`), the
`structured_outputs` object, and the legacy `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. They ride the request models' extras (pdpool.protocol lets them through).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from pdpool.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from pdpool.engine.structured import limits as caps
from pdpool.engine.structured.limits import SpecTooLarge, StructuredLimits
from pdpool.engine.structured.schema_support import SchemaUnsupported, check_supported
from pdpool.engine.structured.spec import (
    GuidedSpec,
    choice_grammar,
    json_schema_spec,
    with_prefix,
)
from pdpool.protocol import RequestError

_LEGACY = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
DEFAULT_LIMITS = StructuredLimits()
# Where specs are checked: off the event loop, two at a time (each bounded by the caps);
# apart from the pool that tokenizes, so that checks never hold up unconstrained requests.
_CHECKS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="structured-check")

_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def guided_spec_of(
    extras: dict[str, Any], limits: StructuredLimits = DEFAULT_LIMITS
) -> Optional[GuidedSpec]:
    """The one constraint a body asks for (None: unconstrained); RequestError otherwise."""
    asked: list[tuple[str, str, Any, bool]] = []  # (field, kind, value, compact)
    rf = extras.get("response_format")
    if rf is not None:
        asked += _response_format(rf)
    so = extras.get("structured_outputs")
    if so is not None:
        asked += _structured_outputs(so)
    for field, kind in _LEGACY.items():
        if extras.get(field) is not None:
            asked.append((field, kind, extras[field], False))
    if len(asked) > 1:
        names = ", ".join(sorted({a[0] for a in asked}))
        raise RequestError(f"only one kind of structured output may be given, got {names}")
    if not asked:
        return None
    field, kind, value, compact = asked[0]
    try:
        return _spec(field, kind, value, compact, limits)
    except SpecTooLarge as exc:
        raise RequestError(f"{field}: {exc}", field) from None


def _response_format(rf: Any) -> list[tuple[str, str, Any, bool]]:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError(
            "response_format.type must be 'text', 'json_object' or 'json_schema'",
            "response_format",
        )
    if rf["type"] == "text":
        return []
    if rf["type"] == "json_object":
        return [("response_format", "json_object", None, False)]
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name", ""), str):
        raise RequestError(
            "response_format.json_schema must be an object with a 'schema'", "response_format"
        )
    schema = js.get("schema", {})  # OpenAI: no schema is any JSON
    return [("response_format", "json", schema, False)]


def _structured_outputs(so: Any) -> list[tuple[str, str, Any, bool]]:
    if not isinstance(so, dict):
        raise RequestError("structured_outputs must be an object", "structured_outputs")
    kinds = [k for k in _STRUCTURED_KINDS if so.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise RequestError(
            "structured_outputs: give exactly one of " + ", ".join(_STRUCTURED_KINDS),
            "structured_outputs",
        )
    if kinds[0] == "structural_tag":
        raise RequestError(
            "structured_outputs.structural_tag is not supported by this server",
            "structured_outputs",
        )
    compact = so.get("disable_any_whitespace", False)
    if not isinstance(compact, bool):
        raise RequestError(
            "structured_outputs.disable_any_whitespace must be a boolean", "structured_outputs"
        )
    return [("structured_outputs", kinds[0], so[kinds[0]], compact)]


def _spec(field: str, kind: str, value: Any, compact: bool, limits: StructuredLimits) -> GuidedSpec:
    if kind == "json_object":
        return GuidedSpec("json_object", "", compact=compact)
    if kind == "json":
        spec = json_schema_spec(check_json_schema(value, field, limits), compact)
        caps.check_text(spec.value, "schema", limits)
        return spec
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise RequestError(f"{field}: the choices must be a list of non-empty strings", field)
        caps.check_choices(value, limits)
        return GuidedSpec("grammar", choice_grammar(value))
    if not isinstance(value, str) or not value:
        raise RequestError(f"{field}: the {kind} must be a non-empty string", field)
    caps.check_text(value, kind, limits)
    if kind == "regex":
        caps.check_regex(value, limits)
    return GuidedSpec(kind, value)


def check_json_schema(schema: Any, field: str, limits: StructuredLimits = DEFAULT_LIMITS) -> Any:
    """The schema (a JSON object, or its text) if it is within `limits` and a valid JSON
    Schema; RequestError naming what is wrong otherwise. The caps are checked first: the
    checker recurses once per level, and its time grows with the schema."""
    import json

    import jsonschema

    try:
        if isinstance(schema, str):
            caps.check_text(schema, "schema", limits)
            schema = json.loads(schema)
        caps.check_schema(schema, limits)
    except SpecTooLarge as exc:
        raise RequestError(f"{field}: {exc}", field) from None
    except RecursionError:  # json.loads of a text nested thousands deep
        raise RequestError(f"{field}: the schema nests too deeply", field) from None
    except ValueError as exc:
        raise RequestError(f"{field}: the schema is not valid JSON: {exc}", field) from None
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"{field}: the schema must be a JSON object", field)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise RequestError(
            f"{field}: invalid JSON schema at {where}: {exc.message}", field
        ) from None
    except RecursionError:  # a backstop: the depth cap set above the checker's recursion
        raise RequestError(f"{field}: the schema nests too deeply to check", field) from None
    _check_supported(schema, field)
    return schema


def _check_supported(schema: Any, field: str) -> None:
    try:
        check_supported(schema)
    except SchemaUnsupported as exc:
        raise RequestError(f"{field}: {exc}", field) from None


def logit_bias_of(extras: dict[str, Any], vocab_size: int) -> Optional[dict[int, float]]:
    """OpenAI's logit_bias ({"token id": bias in [-100, 100]}) as token ids."""
    raw = extras.get("logit_bias")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RequestError("logit_bias must be an object of token ids to biases", "logit_bias")
    if not raw:
        return None
    if len(raw) > MAX_LOGIT_BIAS:  # as OpenAI's cap
        raise RequestError(
            f"logit_bias: at most {MAX_LOGIT_BIAS} token ids, got {len(raw)}", "logit_bias"
        )
    out: dict[int, float] = {}
    for key, bias in raw.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else -1
        if not 0 <= token < vocab_size:
            raise RequestError(
                f"logit_bias: token ids must be in [0, {vocab_size}), got {key!r}", "logit_bias"
            )
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise RequestError(
                f"logit_bias: biases must be numbers in [-100, 100], got {bias!r}", "logit_bias"
            )
        out[token] = float(bias)
    return out


def constrain(
    params: SamplingParams,
    extras: dict[str, Any],
    vocab_size: int,
    tool_spec: Optional[GuidedSpec],
    limits: StructuredLimits = DEFAULT_LIMITS,
) -> SamplingParams:
    """The sampling parameters with the body's constraint (or the tools' one: tool_choice
    `required` or a named function) and logit_bias; RequestError for a bad one."""
    guided = guided_spec_of(extras, limits)
    if tool_spec is not None:
        if guided is not None:
            raise RequestError(
                "tool_choice 'required' or a named function cannot be combined with "
                "response_format or structured outputs",
                "tool_choice",
            )
        guided = _tools_within(tool_spec, limits)
    if extras.get("guided_prefix_token_ids") is not None:
        guided = with_prefix(guided, _prefix_ids(extras["guided_prefix_token_ids"], vocab_size))
    bias = logit_bias_of(extras, vocab_size)
    if guided is None and bias is None:
        return params
    return dataclasses.replace(params, guided=guided, logit_bias=bias)


async def constrain_off_loop(
    params: SamplingParams,
    extras: dict[str, Any],
    vocab_size: int,
    tool_spec: Optional[GuidedSpec],
    limits: StructuredLimits,
) -> SamplingParams:
    """`constrain` on the spec-check pool (the event loop serves others meanwhile)."""
    if not _asks_anything(extras, tool_spec):  # most requests: no thread hop
        return params
    check = functools.partial(constrain, params, extras, vocab_size, tool_spec, limits)
    return await asyncio.get_running_loop().run_in_executor(_CHECKS, check)


def _asks_anything(extras: dict[str, Any], tool_spec: Optional[GuidedSpec]) -> bool:
    fields = ("response_format", "structured_outputs", "logit_bias", "guided_prefix_token_ids")
    return tool_spec is not None or any(extras.get(f) is not None for f in (*fields, *_LEGACY))


def _tools_within(spec: GuidedSpec, limits: StructuredLimits) -> GuidedSpec:
    """The tools' schema under the same caps as a body's own schema."""
    import json

    try:
        caps.check_text(spec.value, "tools' schema", limits)
        schema = json.loads(spec.value)
        caps.check_schema(schema, limits)
    except SpecTooLarge as exc:
        raise RequestError(f"tools: {exc}", "tools") from None
    _check_supported(schema, "tools")
    return spec


def _prefix_ids(value: Any, vocab_size: int) -> list[int]:
    """pdpool's continuation field: the tokens a migrated stream already generated."""
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in value
    ):
        raise RequestError(
            f"guided_prefix_token_ids must be a list of token ids in [0, {vocab_size})",
            "guided_prefix_token_ids",
        )
    return value
