"""A JSON Schema `pattern` as EBNF over a JSON string's body, built here from Python's own
parse of the regex rather than by xgrammar.

xgrammar 0.2.9 gets a schema's patterns (`pattern`, `patternProperties` keys,
`propertyNames`) wrong in two ways:
- its Regex-to-automaton builder mistakes an optional group holding a repetition:
  `^(ba+)?$` accepts "a", `^\\d{1,3}(\\.\\d+)?$` accepts "12345";
- a pattern that names `"`, `\\` or a control character is written into the grammar raw:
  `a"b` ends the string early, `^\\n$` puts a raw newline in it (neither is JSON).
So json_grammar.py swaps each pattern for a marker before xgrammar converts the schema,
and replaces the marker's rule with the EBNF built here.

What is emitted here is a subset of what the pattern matches under both readings a client
may validate with (ECMA-262, which JSON Schema names, and Python's `re`, which jsonschema
uses): where the two differ (`\\w`, `\\d`, `\\s` on non-ASCII, `.` on line separators),
only what both accept. Control characters stay out, as xgrammar has it; `"` and `\\` come
escaped. A pattern is matched whole: a sentence matched whole is also found by a search,
which is what JSON Schema asks. Constructs with no such subset (look-around, back-
references, anchors or flags inside the pattern) are refused with a ValueError (a 400).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

if sys.version_info >= (3, 11):
    from re import _constants as sre_c
    from re import _parser as sre_parse
else:  # pragma: no cover - Python 3.10
    import sre_constants as sre_c
    import sre_parse

Ranges = list[tuple[int, int]]  # sorted, disjoint, inclusive code point ranges

MAX_CODEPOINT = 0x10FFFF
# Kept out of every class: control characters (RFC 8259 wants them escaped; the model is
# not offered them) and surrogates (no UTF-8 of their own).
_EXCLUDED: Ranges = [(0x00, 0x1F), (0xD800, 0xDFFF)]
# Written as a two-character escape inside a JSON string.
_ESCAPED = {ord('"'): '"\\\\\\""', ord("\\"): '"\\\\\\\\"'}

_DIGIT: Ranges = [(0x30, 0x39)]
_WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_ASCII_SPACE: Ranges = [(0x09, 0x0D), (0x20, 0x20)]
# Python's non-ASCII digits, word characters and spaces all lie at or above U+0080, and its
# extra ASCII spaces are U+001C-U+001F: so each class read as the larger of the two
# readings is within these bounds.
_NON_ASCII: Ranges = [(0x80, MAX_CODEPOINT)]


def _union(*sets: Ranges) -> Ranges:
    merged: Ranges = []
    for lo, hi in sorted(r for s in sets for r in s):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _complement(ranges: Ranges) -> Ranges:
    out: Ranges = []
    start = 0
    for lo, hi in _union(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODEPOINT:
        out.append((start, MAX_CODEPOINT))
    return out


def _minus(ranges: Ranges, removed: Ranges) -> Ranges:
    return _complement(_union(_complement(ranges), removed))


# category -> (what both readings match, what either reading may match)
_CATEGORIES: dict[Any, tuple[Ranges, Ranges]] = {
    sre_c.CATEGORY_DIGIT: (_DIGIT, _union(_DIGIT, _NON_ASCII)),
    sre_c.CATEGORY_WORD: (_WORD, _union(_WORD, _NON_ASCII)),
    sre_c.CATEGORY_SPACE: (_ASCII_SPACE, _union(_ASCII_SPACE, [(0x1C, 0x1F)], _NON_ASCII)),
}
for _name, _negated in (
    (sre_c.CATEGORY_NOT_DIGIT, sre_c.CATEGORY_DIGIT),
    (sre_c.CATEGORY_NOT_WORD, sre_c.CATEGORY_WORD),
    (sre_c.CATEGORY_NOT_SPACE, sre_c.CATEGORY_SPACE),
):
    _inner, _outer = _CATEGORIES[_negated]
    _CATEGORIES[_name] = (_complement(_outer), _complement(_inner))
# `.`: Python leaves out \n; ECMA-262 also \r, U+2028 and U+2029.
_ANY = _complement([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)])

# Python's parse names -> what a client wrote
_UNSUPPORTED = {
    "ASSERT": "look-arounds ((?=...), (?<=...))",
    "ASSERT_NOT": "negative look-arounds ((?!...), (?<!...))",
    "GROUPREF": "back-references",
    "GROUPREF_EXISTS": "conditional groups",
    "ATOMIC_GROUP": "atomic groups",
    "POSSESSIVE_REPEAT": "possessive repetitions",
}
_BEGIN = (sre_c.AT_BEGINNING, sre_c.AT_BEGINNING_STRING)
_END = (sre_c.AT_END, sre_c.AT_END_STRING)


def pattern_ebnf(pattern: str) -> str:
    """An EBNF expression for the body of a JSON string that `pattern` matches whole.
    ValueError (why) when the pattern cannot be parsed, uses what has no exact subset here,
    or leaves no string this grammar can write."""
    try:
        parsed = sre_parse.parse(pattern)
    except Exception as exc:  # re.error, and the odd OverflowError or RecursionError
        raise ValueError(f"the pattern {pattern!r} cannot be parsed: {exc}") from None
    if parsed.state.flags & ~sre_c.SRE_FLAG_UNICODE:
        raise ValueError(f"the pattern {pattern!r}: inline flags are not supported")
    try:
        body = _sequence(_strip_anchors(list(parsed)))
    except ValueError as exc:
        raise ValueError(f"the pattern {pattern!r}: {exc}") from None
    if body is None:
        raise ValueError(f"the pattern {pattern!r} matches no string without control characters")
    return body


def _strip_anchors(items: list[Any]) -> list[Any]:
    """The top level without a leading ^ and a trailing $ (the whole string is matched
    anyway); a top-level alternation has its branches stripped alike."""
    if len(items) == 1 and items[0][0] is sre_c.BRANCH:
        branches = [_strip_anchors(list(b)) for b in items[0][1][1]]
        return [(sre_c.BRANCH, (None, branches))]
    if items and items[0][0] is sre_c.AT and items[0][1] in _BEGIN:
        items = items[1:]
    if items and items[-1][0] is sre_c.AT and items[-1][1] in _END:
        items = items[:-1]
    return items


def _sequence(items: Any) -> Optional[str]:
    parts = []
    for op, av in items:
        part = _item(op, av)
        if part is None:
            return None
        parts.append(part)
    return " ".join(parts) if parts else '""'


def _item(op: Any, av: Any) -> Optional[str]:
    if op is sre_c.LITERAL:
        return _chars([(av, av)])
    if op is sre_c.NOT_LITERAL:
        return _chars(_complement([(av, av)]))
    if op is sre_c.ANY:
        return _chars(_ANY)
    if op is sre_c.IN:
        return _chars(_class(av))
    if op is sre_c.BRANCH:
        alternatives = [a for a in (_sequence(b) for b in av[1]) if a is not None]
        return "(" + " | ".join(alternatives) + ")" if alternatives else None
    if op is sre_c.SUBPATTERN:
        _group, add_flags, del_flags, sub = av
        if add_flags or del_flags:
            raise ValueError("inline flags in a group are not supported in a pattern")
        inner = _sequence(sub)
        return None if inner is None else f"({inner})"
    if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT):
        return _repeat(*av)
    if op is sre_c.AT:
        raise ValueError("anchors other than a leading ^ and a trailing $ are not supported")
    raise ValueError(f"{_UNSUPPORTED.get(str(op), str(op).lower())} are not supported in a pattern")


_MAX_BOUND = 2**31 - 1  # xgrammar's repetition bounds are 32-bit


def _repeat(low: int, high: int, sub: Any) -> Optional[str]:
    inner = _sequence(sub)
    if inner is None:
        return '""' if low == 0 else None
    unbounded = high == sre_c.MAXREPEAT
    if low > _MAX_BOUND or (not unbounded and high > _MAX_BOUND):
        raise ValueError(f"a repetition bound above {_MAX_BOUND} is not supported")
    if unbounded:
        suffix = {0: "*", 1: "+"}.get(low, f"{{{low},}}")
    else:
        suffix = "?" if (low, high) == (0, 1) else f"{{{low},{high}}}"
    return f"({inner}){suffix}"


def _class(items: Any) -> Ranges:
    """What both readings match of a [...] class: of its items, or (negated) outside every
    item as the wider reading has it."""
    both: list[Ranges] = []
    either: list[Ranges] = []
    negate = False
    for op, av in items:
        if op is sre_c.NEGATE:
            negate = True
        elif op in (sre_c.LITERAL, sre_c.RANGE):
            exact = [(av, av)] if op is sre_c.LITERAL else [av]
            both.append(exact)
            either.append(exact)
        elif op is sre_c.CATEGORY:
            both.append(_CATEGORIES[av][0])
            either.append(_CATEGORIES[av][1])
        else:
            raise ValueError(f"{str(op).lower()} is not supported in a character class")
    return _complement(_union(*either)) if negate else _union(*both)


def _chars(ranges: Ranges) -> Optional[str]:
    """One character of `ranges` as it is written inside a JSON string; None if none can."""
    plain = _minus(ranges, _union(_EXCLUDED, [(c, c) for c in _ESCAPED]))
    escaped = [text for c, text in _ESCAPED.items() if any(lo <= c <= hi for lo, hi in ranges)]
    options = (["[" + "".join(_range_text(r) for r in plain) + "]"] if plain else []) + escaped
    if not options:
        return None
    return options[0] if len(options) == 1 else "(" + " | ".join(options) + ")"


def _range_text(bounds: tuple[int, int]) -> str:
    lo, hi = bounds
    return _escape(lo) if lo == hi else f"{_escape(lo)}-{_escape(hi)}"


def _escape(codepoint: int) -> str:
    return f"\\u{codepoint:04x}" if codepoint <= 0xFFFF else f"\\U{codepoint:08x}"
