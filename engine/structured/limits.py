"""Caps on a structured-output spec's size, checked in the HTTP process before anything is
parsed deeply or compiled: each check is one iterative walk (no recursion, so no depth can
overflow the stack) and its refusal names the limit and the flag that sets it.

Why caps: xgrammar's compile time grows faster than linearly with a spec's size (20,000
choices: 30 s and more; 8,000 properties: a minute on a 152k vocabulary), and
jsonschema's checker recurses once per level. The defaults follow OpenAI's structured
outputs (1,000 enum values, thousands of properties) and this server's body nesting cap,
so real schemas pass and what compiles for seconds rarely does. No heavy imports: the HTTP
process uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdpool.protocol import MAX_JSON_DEPTH
from pdpool.settings_flags import setting


class SpecTooLarge(ValueError):
    """A spec over one of the caps (answered 400, naming the cap)."""


def _cap(default: int, what: str) -> Any:
    return setting(
        default,
        help=f"structured outputs: at most this many {what}; above it, 400 (default %(default)s)",
    )


@dataclass(frozen=True)
class StructuredLimits:
    """`pdpool serve --structured-max-*` (a field per flag, pdpool/settings_flags.py)."""

    # the spec's text: a schema's JSON, a regex, a grammar, the choices together (bytes)
    max_bytes: int = _cap(
        256 * 1024, "bytes of a spec's text (schema JSON, regex, grammar, the choices together)"
    )
    # object properties in a schema, all objects together (OpenAI allows 5,000; 2,000 keeps
    # compiles within seconds on a 152k vocabulary)
    max_properties: int = _cap(2000, "object properties in a JSON schema, all objects together")
    # nesting of a schema's JSON (objects and arrays), as the request body's own cap
    max_depth: int = _cap(MAX_JSON_DEPTH, "levels of nesting (objects and arrays) in a JSON schema")
    # enum and const values in a schema, all enums together (OpenAI: 1,000)
    max_enum_values: int = _cap(1000, "enum and const values in a JSON schema, all together")
    # guided_choice alternatives (one enum: the same cap's reasoning)
    max_choices: int = _cap(1000, "guided_choice alternatives")
    # a regex: guided_regex, or a schema's `pattern` / `patternProperties` key
    max_pattern_chars: int = _cap(
        4096, "characters of a regex (guided_regex, or a schema's pattern)"
    )

    def validate(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--structured-{name.replace('_', '-')} must be >= 1")


def _over(what: str, got: int, limit: int, flag: str) -> SpecTooLarge:
    return SpecTooLarge(f"{what} is {got}, over the limit of {limit} (--structured-{flag})")


def check_text(text: str, what: str, limits: StructuredLimits) -> None:
    """A spec given as text (a schema's JSON, a grammar): its size in bytes."""
    # A character is at most 4 bytes: most texts pass without being encoded.
    size = len(text) if len(text) * 4 <= limits.max_bytes else len(text.encode())
    if size > limits.max_bytes:
        raise _over(f"the {what}'s size in bytes", size, limits.max_bytes, "max-bytes")


def check_regex(pattern: str, limits: StructuredLimits) -> None:
    if len(pattern) > limits.max_pattern_chars:
        raise _over(
            "the regex's length", len(pattern), limits.max_pattern_chars, "max-pattern-chars"
        )


def check_choices(choices: list[str], limits: StructuredLimits) -> None:
    if len(choices) > limits.max_choices:
        raise _over("the number of choices", len(choices), limits.max_choices, "max-choices")
    check_text("".join(choices), "choices", limits)


def check_schema(schema: Any, limits: StructuredLimits) -> None:
    """A parsed schema's depth, properties, enum values and patterns (one walk, iterative;
    it stops at the first cap passed)."""
    counts = {"properties": 0, "enum": 0}
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limits.max_depth:
            raise _over("the schema's nesting depth", depth, limits.max_depth, "max-depth")
        if isinstance(node, dict):
            _count_keywords(node, counts, limits)
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))


def _count_keywords(node: dict[str, Any], counts: dict[str, int], limits: StructuredLimits) -> None:
    props = node.get("properties")
    if isinstance(props, dict):
        counts["properties"] += len(props)
        if counts["properties"] > limits.max_properties:
            raise _over(
                "the schema's number of properties",
                counts["properties"],
                limits.max_properties,
                "max-properties",
            )
    enum = node.get("enum")
    counts["enum"] += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
    if counts["enum"] > limits.max_enum_values:
        raise _over(
            "the schema's number of enum values",
            counts["enum"],
            limits.max_enum_values,
            "max-enum-values",
        )
    patterns = [node.get("pattern")]
    if isinstance(node.get("patternProperties"), dict):
        patterns += node["patternProperties"].keys()
    for pattern in patterns:
        if isinstance(pattern, str) and len(pattern) > limits.max_pattern_chars:
            raise _over(
                "a schema pattern's length",
                len(pattern),
                limits.max_pattern_chars,
                "max-pattern-chars",
            )
