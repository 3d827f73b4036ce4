"""The schemas that guided-decoding validity is checked against (tests/structured and
benchmarks/structured_validity.py): one per kind of constraint a client commonly sends, and
tools built from them. Outputs are judged by `strictly_valid`: RFC 8259 JSON (json.loads
refuses raw control characters in strings) that validates against the schema."""

from __future__ import annotations

import json
from typing import Any, Optional

import jsonschema

SCHEMAS: dict[str, dict[str, Any]] = {
    "max_length": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "note": {"type": "string", "minLength": 1, "maxLength": 40},
            "code": {"type": "string", "minLength": 2, "maxLength": 4},
        },
        "required": ["name", "note", "code"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "slug": {"type": "string", "pattern": "^[a-z][a-z0-9_]{0,15}$"},
            "any": {"type": "string", "pattern": "^.{1,10}$"},
        },
        "required": ["id", "slug", "any"],
    },
    "enum": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"enum": [1, "xl", None, True, "a\nb"]},
            "level": {"const": "high"},
        },
        "required": ["color", "size", "level"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "owner": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 10},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "address": {
                "type": "object",
                "properties": {
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    "geo": {
                        "type": "object",
                        "properties": {
                            "lat": {"type": "number", "minimum": -90, "maximum": 90},
                            "lon": {"type": "number", "minimum": -180, "maximum": 180},
                        },
                        "required": ["lat", "lon"],
                    },
                },
                "required": ["zip", "geo"],
            },
        },
        "required": ["owner", "address"],
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": 6},
                "minItems": 1,
                "maxItems": 4,
            },
            "grid": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 2,
                    "maxItems": 3,
                },
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["tags", "grid"],
    },
    "numbers": {
        "type": "object",
        "properties": {
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "temp": {"type": "number", "minimum": -50.5, "maximum": 60},
            "delta": {"type": "integer", "minimum": -100, "exclusiveMaximum": 100},
        },
        "required": ["days", "ratio", "temp", "delta"],
    },
}

TOOLS = [
    {"type": "function", "function": {"name": "record", "parameters": SCHEMAS["max_length"]}},
    {"type": "function", "function": {"name": "locate", "parameters": SCHEMAS["nested"]}},
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def strictly_valid(text: Optional[str], schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text or ""), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def calls_valid(calls: list[tuple[str, str]]) -> bool:
    """(name, arguments) pairs: at least one, each a known tool with valid arguments."""
    return bool(calls) and all(
        name in TOOL_SCHEMAS and strictly_valid(args, TOOL_SCHEMAS[name]) for name, args in calls
    )
