r"""A JSON Schema as an xgrammar grammar whose every sentence is RFC 8259 JSON.

xgrammar 0.2.8 (vLLM 0.32's too) converts a schema to EBNF with two kinds of string rule
that let raw control characters (U+0000-U+001F) into a string, which RFC 8259 forbids and
a strict json.loads refuses:
- a string with minLength/maxLength: each character is `[^"\\\r\n]` (U+000B, U+001B ...
  pass; escapes do not);
- the json-pointer formats: `[\0-.]` and `[0-}]` (control characters, and a raw `"` or `\`
  that ends or breaks the string); fixed in xgrammar 0.2.9, whose EBNF no longer has it.
Their plain string rule is right. Its patterns are wrong too: each is given to xgrammar as
a marker, whose rule is then replaced by one built here (pattern_grammar.py). So the schema
goes through xgrammar's own converter and the faulty rules are replaced in its EBNF text; a
schema without them compiles from xgrammar's grammar unchanged (the same masks as stock
vLLM). A subschema without `type` is given the type its keywords are about (`maxLength`:
string), which xgrammar would otherwise ignore.

Whitespace under any_whitespace is bounded per gap (xgrammar's max_whitespace_cnt): a weak
model could otherwise spend max_tokens on blanks and leave JSON that does not parse.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Optional

import xgrammar as xgr

from pdpool.engine.structured.pattern_grammar import pattern_ebnf
from pdpool.engine.structured.schema_support import ALONE, keyword_types, subschemas

# Blanks allowed between two JSON tokens: a newline and an indent of 7 (indent 2 nests three
# levels; deeper, a model's output stays valid JSON, indented less). Every gap of a schema's
# JSON may be filled, so this times the gaps bounds the blanks.
MAX_WHITESPACE = 8

# One character of a length-bounded string: anything but a control character, `"` or `\`,
# or an escape. Surrogates are left out, raw and escaped: xgrammar takes the bytes of one
# (ED A0 80, not UTF-8) for a character, which decode to three U+FFFD; JSON Schema counts a
# \uD83D\uDE00 pair as one character, the grammar's repetition would count two.
_CHAR = r'(([^\0-\x1f\"\\\uD800-\uDFFF]) | ("\\" pdpool_length_escape))'
_ESCAPE_RULE = (
    r'pdpool_length_escape ::= (([\"\\/bfnrt]) | ("u" [0-9A-Ca-c] pdpool_hex{3, 3}) | '
    r'("u" [Dd] [0-7] pdpool_hex{2, 2}) | ("u" [EeFf] pdpool_hex{3, 3}))'
    "\n"
    r"pdpool_hex ::= (([0-9A-Fa-f]))"
)
# xgrammar's character class of a string with minLength/maxLength: a rule's whole body, or
# inline (maxLength 1 is `("" | ([^\"\\\r\n]))`, a length of exactly 1 the bare class).
FAULTY_LENGTH_CHAR = r"[^\"\\\r\n]"
# xgrammar's json-pointer reference token: [\0-.] and [0-}] span U+0000-U+001F, `"`, `\`.
FAULTY_POINTER_CHARS = r"([\0-.]) | ([0-}])"
_POINTER_CHARS = r"([ !#-.]) | ([0-\[]) | ([\]-}])"
# xgrammar prints U+0080-U+00FF (and other controls) as \xHH, but its parser reads \x
# greedily: "\xe92" (é then 2) comes back as U+0E92. \u00HH is read as four digits.
_BYTE_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\x([0-9a-fA-F]{2})")


def schema_grammar(schema: str, compact: bool) -> xgr.Grammar:
    """The grammar of `schema` (JSON text): compact JSON, or any whitespace within bounds.
    ValueError when one of its patterns has no grammar (pattern_grammar.py)."""
    prepared, patterns = _for_xgrammar(schema)
    grammar = xgr.Grammar.from_json_schema(
        prepared,
        any_whitespace=not compact,
        separators=(",", ":") if compact else None,
        max_whitespace_cnt=None if compact else MAX_WHITESPACE,
    )
    fixed = corrected_ebnf(str(grammar), patterns)
    return grammar if fixed is None else xgr.Grammar.from_ebnf(fixed)


def _for_xgrammar(schema: str) -> tuple[str, dict[str, str]]:
    """`schema` typed where its keywords say, its patterns replaced by markers, and each
    marker's EBNF. A schema that is not JSON comes back unchanged, for xgrammar to refuse."""
    try:
        parsed = json.loads(schema)
    except ValueError:
        return schema, {}
    nonce = secrets.token_hex(6)
    markers: dict[str, str] = {}

    def marker(pattern: str) -> str:
        name = f"pdpoolpattern{len(markers)}x{nonce}"
        markers[name] = pattern_ebnf(pattern)
        return f"^{name}$"

    typed = 0
    for _where, node in subschemas(parsed):
        typed += _give_type(node)
        if isinstance(node.get("pattern"), str):
            node["pattern"] = marker(node["pattern"])
        keyed = node.get("patternProperties")
        if isinstance(keyed, dict):
            node["patternProperties"] = {marker(k): v for k, v in keyed.items()}
    return (json.dumps(parsed), markers) if markers or typed else (schema, {})


def _give_type(node: dict[str, Any]) -> bool:
    """Types an untyped subschema by its keywords: what validates is then a subset."""
    if "type" in node or any(key in node for key in ALONE):
        return False
    types = keyword_types(node)
    if types:
        node["type"] = types[0] if len(types) == 1 else types
    return bool(types)


def corrected_ebnf(ebnf: str, patterns: Optional[dict[str, str]] = None) -> Optional[str]:
    """xgrammar's EBNF with its faulty string rules replaced, and the rule of each pattern
    marker by its EBNF (`patterns`, pattern_grammar.py); None when there is none of either."""
    length_rules = ebnf.count(FAULTY_LENGTH_CHAR)
    fixed = ebnf.replace(FAULTY_LENGTH_CHAR, _CHAR)
    fixed, pointer_rules = re.subn(re.escape(FAULTY_POINTER_CHARS), lambda _: _POINTER_CHARS, fixed)
    for name, body in (patterns or {}).items():
        fixed = fixed.replace(f'Regex("^{name}$", json_string=true)', f"({body})")
    if not length_rules and not pointer_rules and not patterns:
        return None
    fixed = _BYTE_ESCAPE.sub(lambda m: m.group(1) + "\\u00" + m.group(2), fixed)
    return fixed + "\n" + _ESCAPE_RULE + "\n" if length_rules else fixed
