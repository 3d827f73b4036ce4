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
    for where, node in _subschemas(schema):
        why = _unsupported(node)
        if why is not None:
            raise SchemaUnsupported(
                f"the schema at {where or '(root)'}: {why}; outputs could not be guaranteed "
                "to validate"
            )


def _subschemas(schema: Any) -> Iterator[tuple[str, dict[str, Any]]]:
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
    if node.get("uniqueItems") is True:
        return "'uniqueItems' is ignored by the grammar"
    if "multipleOf" in node and node.get("type") != "integer":
        return "'multipleOf' is enforced only for type integer"
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        return "minLength/maxLength together with 'pattern' or 'format' are ignored"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' of more than one schema is not enforced (merge them into one)"
    if isinstance(node.get("oneOf"), list) and not _exclusive(node["oneOf"]):
        return "'oneOf' is enforced as 'anyOf' (use anyOf, or branches of distinct types)"
    return _object_combination(node)


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
