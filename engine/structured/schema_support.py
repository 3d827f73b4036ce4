"""JSON Schema keywords the grammar cannot enforce, refused up front (a 400 naming the
keyword) rather than generating output that fails the schema: xgrammar 0.2.8 ignores them
or enforces something else. Found by its matcher (and vLLM 0.32's list, which refuses or
falls back for most of these too). One iterative walk over the subschemas only (a property
named "not" is no keyword); the HTTP process runs it, after the size caps.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

# keyword -> why it is refused
_IGNORED = {
    "not": "is ignored by the grammar",
    "if": "(if/then/else) is ignored by the grammar",
    "contains": "is ignored by the grammar",
    "minContains": "is ignored by the grammar",
    "maxContains": "is ignored by the grammar",
    "dependentRequired": "is ignored by the grammar",
    "dependentSchemas": "is ignored by the grammar",
    "dependencies": "is ignored by the grammar",
}
# The keywords that constrain one JSON type's values. Nothing else infers a schema's type
# from them: without a `type`, xgrammar ignores all but `properties` and `items`.
KEYWORDS_BY_TYPE = {
    "string": ("pattern", "format", "minLength", "maxLength"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": (
        "items", "prefixItems", "minItems", "maxItems", "contains", "minContains",
        "maxContains", "uniqueItems", "unevaluatedItems", "additionalItems",
    ),
    "object": (
        "properties", "required", "additionalProperties", "patternProperties",
        "propertyNames", "minProperties", "maxProperties", "unevaluatedProperties",
        "dependentRequired", "dependentSchemas", "dependencies",
    ),
}  # fmt: skip
# Where one of these stands, xgrammar reads nothing else of the schema: another constraint
# beside it would be ignored (`type` beside `enum` or `const` is checked value by value).
ALONE = ("anyOf", "oneOf", "allOf", "$ref", "enum", "const")
_CONSTRAINTS = frozenset(
    [k for keys in KEYWORDS_BY_TYPE.values() for k in keys]
    + ["type", "not", "if", "then", "else", *ALONE]
)
_ADVICE = {"$ref": "move it into the referenced schema", "enum": "list only the values that fit"}
_ADVICE["const"] = _ADVICE["enum"]
_JSON_TYPES = {type(None): "null", bool: "boolean", str: "string", list: "array", dict: "object"}
# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = (
    "items", "additionalProperties", "not", "if", "then", "else", "contains",
    "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems",
)  # fmt: skip
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class SchemaUnsupported(ValueError):
    """A schema using a keyword the grammar would not enforce (answered 400)."""


def check_supported(schema: Any) -> None:
    """SchemaUnsupported naming the first keyword (and where) that the grammar ignores."""
    for where, node in subschemas(schema):
        why = _unsupported(node)
        if why is not None:
            raise SchemaUnsupported(
                f"the schema at {where or '(root)'}: {why}; outputs could not be guaranteed "
                "to validate"
            )


def subschemas(schema: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        where, node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield where, node
        for key in _ONE:
            if isinstance(node.get(key), dict):
                stack.append((f"{where}/{key}", node[key]))
        for key in _LIST:
            if isinstance(node.get(key), list):
                stack.extend((f"{where}/{key}/{i}", s) for i, s in enumerate(node[key]))
        for key in _MAP:
            if isinstance(node.get(key), dict):
                stack.extend((f"{where}/{key}/{k}", s) for k, s in node[key].items())


def _unsupported(node: dict[str, Any]) -> Optional[str]:
    for key, why in _IGNORED.items():
        if key in node:
            return f"'{key}' {why}"
    beside = _ignored_beside(node)
    if beside is not None:
        return beside
    if node.get("uniqueItems") is True:
        return "'uniqueItems' is ignored by the grammar"
    multiple = _multiple_of(node) if "multipleOf" in node else None
    if multiple is not None:
        return multiple
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        return "minLength/maxLength together with 'pattern' or 'format' are ignored"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' of more than one schema is not enforced (merge them into one)"
    if isinstance(node.get("oneOf"), list) and not _exclusive(node["oneOf"]):
        return "'oneOf' is enforced as 'anyOf' (use anyOf, or branches of distinct types)"
    return _object_combination(node)


def _ignored_beside(node: dict[str, Any]) -> Optional[str]:
    for key in ALONE:
        if key not in node:
            continue
        typed_values = key in ("enum", "const")
        others = sorted(k for k in node if k in _CONSTRAINTS and k != key)
        if "type" in others and (typed_values or _branches_within_type(node, key)):
            others.remove("type")
        if others:
            advice = _ADVICE.get(key, "move it into each branch")
            return f"'{others[0]}' beside '{key}' is ignored by the grammar ({advice})"
        if typed_values and "type" in node:
            return _value_of_another_type(node, key)
    return None


def keyword_types(node: dict[str, Any]) -> list[str]:
    """The types whose keywords `node` uses (KEYWORDS_BY_TYPE)."""
    return [t for t, keys in KEYWORDS_BY_TYPE.items() if any(k in node for k in keys)]


def _branches_within_type(node: dict[str, Any], key: str) -> bool:
    """`type` beside a combination is moot when each branch is already of that type: by
    its own `type`, its values, or (untyped) its keywords, as the grammar then types it."""
    allowed = set(node["type"] if isinstance(node["type"], list) else [node["type"]])
    if "number" in allowed:
        allowed.add("integer")
    branches = node[key] if isinstance(node[key], list) else []
    return bool(branches) and all(_branch_within(b, allowed) for b in branches)


def _branch_within(branch: Any, allowed: set[str]) -> bool:
    if not isinstance(branch, dict) or any(
        k in branch for k in ALONE if k not in ("enum", "const")
    ):
        return False
    if "type" in branch:
        types = branch["type"] if isinstance(branch["type"], list) else [branch["type"]]
        return all(t in allowed for t in types)
    if "enum" in branch or "const" in branch:
        values = branch["enum"] if isinstance(branch.get("enum"), list) else [branch.get("const")]
        return all(_json_types(v) & allowed for v in values)
    types = keyword_types(branch)
    return bool(types) and all(t in allowed for t in types)


def _value_of_another_type(node: dict[str, Any], key: str) -> Optional[str]:
    types = node["type"] if isinstance(node["type"], list) else [node["type"]]
    values = node[key] if key == "enum" and isinstance(node[key], list) else [node[key]]
    for value in values:
        if not _json_types(value) & set(types):
            return f"the '{key}' value {value!r} is not of type {node['type']!r}"
    return None


def _json_types(value: Any) -> set[str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return {_JSON_TYPES.get(type(value), "?")}
    whole = isinstance(value, int) or value.is_integer()
    return {"number", "integer"} if whole else {"number"}


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _multiple_of(node: dict[str, Any]) -> Optional[str]:
    step = node["multipleOf"]
    if node.get("type") != "integer":
        return "'multipleOf' is enforced only for type integer"
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        return "'multipleOf' is enforced only as a whole number of at least 1"
    if any(bound in node for bound in _BOUNDS):
        return "'multipleOf' is not enforced together with minimum or maximum"
    return None


def _object_combination(node: dict[str, Any]) -> Optional[str]:
    if "propertyNames" in node and (
        "properties" in node
        or "patternProperties" in node
        or node.get("unevaluatedProperties", True) is not True
    ):
        return "'propertyNames' with properties or patternProperties is not enforced"
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict) and len(patterns) > 1:
        return "'patternProperties' with more than one pattern is not enforced"
    named = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    for name in required:
        if isinstance(name, str) and name not in named:
            return f"'required' names {name!r}, which is not under 'properties': not enforced"
    return _min_properties(node)


def _min_properties(node: dict[str, Any]) -> Optional[str]:
    """The grammar counts keys as written, and one written by additionalProperties,
    patternProperties or propertyNames may repeat (JSON keeps the last): only the required
    properties are sure to be distinct."""
    least = node.get("minProperties")
    required = node.get("required")
    distinct = len({k for k in required if isinstance(k, str)}) if isinstance(required, list) else 0
    keys_may_repeat = (
        node.get("additionalProperties", False) is not False
        or "patternProperties" in node
        or "propertyNames" in node
    )
    if keys_may_repeat and isinstance(least, int) and least > distinct:
        return (
            "'minProperties' beyond the required properties is not enforced where other "
            "keys are allowed (a key may repeat)"
        )
    return None


def _exclusive(branches: list[Any]) -> bool:
    """oneOf = anyOf when no value can match two branches: each branch one distinct JSON
    type (integer and number overlap), or each an object told apart by one required
    property's const (a discriminated union)."""
    types = [b.get("type") if isinstance(b, dict) else None for b in branches]
    if all(isinstance(t, str) for t in types) and len(set(types)) == len(types):
        return not {"integer", "number"} <= set(types)
    return _discriminated(branches)


def _discriminated(branches: list[Any]) -> bool:
    if not all(isinstance(b, dict) and isinstance(b.get("properties"), dict) for b in branches):
        return False
    for key in branches[0]["properties"]:
        values = [_const_of(b, key) for b in branches]
        if all(v is not None for v in values) and len(set(values)) == len(values):
            return True
    return False


def _const_of(branch: dict[str, Any], key: str) -> Optional[str]:
    prop = branch["properties"].get(key)
    if key not in branch.get("required", ()) or not isinstance(prop, dict):
        return None
    if "const" in prop:
        return repr(prop["const"])
    enum = prop.get("enum")
    return repr(enum[0]) if isinstance(enum, list) and len(enum) == 1 else None
