"""The request body's nesting check (pdpool.protocol): the same answer as the depth of the
parsed value, whether the body has few brackets (counted) or many (strings stripped)."""

from __future__ import annotations

import json
import random

import pytest

from pdpool.protocol import RequestError, _nesting_exceeds, parse_json_body

MAX = 8


def depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


def nested(levels: int, leaf=1):
    value = leaf
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


def cases():
    yield nested(MAX), "at the limit"
    yield nested(MAX + 1), "one over"
    yield {"prompt": "[" * 50 + "{" * 50}, "brackets only in a string"
    yield {"prompt": "[[{" * 20, "messages": [nested(MAX - 1)]}, "strings' brackets and real ones"
    yield {"prompt": "]" * 30 + "[" * 30, "x": nested(MAX)}, "one over, strings' brackets"
    yield [[1, 2], {"a": [3]}, [[[]]]] * 10, "many shallow brackets"
    yield {"a": '\\"[[[[[[[[[[', "b": nested(MAX - 1)}, "escaped quotes before brackets"
    rng = random.Random(0)
    for n in range(40):  # random shapes around the limit
        value = nested(rng.randint(MAX - 2, MAX + 2), "[" * rng.randint(0, 12))
        yield [value, "{" * rng.randint(0, 12), [value] * rng.randint(0, 3)], f"random {n}"


@pytest.mark.parametrize("value,label", list(cases()))
def test_the_check_agrees_with_the_parsed_depth(value, label):
    raw = json.dumps(value).encode()
    assert _nesting_exceeds(raw, MAX) == (depth(value) > MAX), label
    if depth(value) > MAX:
        with pytest.raises(RequestError, match="nests deeper"):
            parse_json_body(raw, MAX)
    else:
        assert parse_json_body(raw, MAX) == value
