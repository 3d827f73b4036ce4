r"""A JSON Schema as an xgrammar grammar whose every sentence is RFC 8259 JSON.

xgrammar 0.2.8 (vLLM 0.32's too) converts a schema to EBNF with two kinds of string rule
that let raw control characters (U+0000-U+001F) into a string, which RFC 8259 forbids and
a strict json.loads refuses:
- a string with minLength/maxLength: each character is `[^"\\\r\n]` (U+000B, U+001B ...
  pass; escapes do not);
- the json-pointer formats: `[\0-.]` and `[0-}]` (control characters, and a raw `"` or `\`
  that ends or breaks the string); fixed in xgrammar 0.2.9, whose EBNF no longer has it.
Their plain string rule is right. So the schema goes through xgrammar's own converter and
the faulty rules are replaced in its EBNF text; a schema without them compiles from
xgrammar's grammar unchanged (the same masks as stock vLLM).

Whitespace under any_whitespace is bounded per gap (xgrammar's max_whitespace_cnt): a weak
model could otherwise spend max_tokens on blanks and leave JSON that does not parse.
"""

from __future__ import annotations

import re
from typing import Optional

import xgrammar as xgr

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
# xgrammar's character rule of a string with minLength/maxLength (the whole rule's body).
FAULTY_LENGTH_CHAR = r"(([^\"\\\r\n]))"
_LENGTH_RULE = re.compile(r"^(\w+ ::= )" + re.escape(FAULTY_LENGTH_CHAR) + "$", re.MULTILINE)
# xgrammar's json-pointer reference token: [\0-.] and [0-}] span U+0000-U+001F, `"`, `\`.
FAULTY_POINTER_CHARS = r"([\0-.]) | ([0-}])"
_POINTER_CHARS = r"([ !#-.]) | ([0-\[]) | ([\]-}])"


def schema_grammar(schema: str, compact: bool) -> xgr.Grammar:
    """The grammar of `schema` (JSON text): compact JSON, or any whitespace within bounds."""
    grammar = xgr.Grammar.from_json_schema(
        schema,
        any_whitespace=not compact,
        separators=(",", ":") if compact else None,
        max_whitespace_cnt=None if compact else MAX_WHITESPACE,
    )
    fixed = corrected_ebnf(str(grammar))
    return grammar if fixed is None else xgr.Grammar.from_ebnf(fixed)


def corrected_ebnf(ebnf: str) -> Optional[str]:
    """xgrammar's EBNF with its faulty string rules replaced; None when it has none."""
    fixed, length_rules = _LENGTH_RULE.subn(lambda m: m.group(1) + _CHAR, ebnf)
    fixed, pointer_rules = re.subn(re.escape(FAULTY_POINTER_CHARS), lambda _: _POINTER_CHARS, fixed)
    if not length_rules and not pointer_rules:
        return None
    return fixed + "\n" + _ESCAPE_RULE + "\n" if length_rules else fixed
