"""Random JSON schemas, and random sentences of their grammars, judged by strict json.loads
and jsonschema: the class of schema a client may send, not a fixed list.

A schema mixes the keywords the engine accepts (and some it refuses): strings with lengths,
patterns (nested groups and repetitions, quotes, backslashes) and formats; integers and
numbers with bounds and multipleOf; enums and consts of every JSON type; objects with
required, additional, pattern and named properties in keys with quotes, backslashes and
non-ASCII; arrays with items, prefixItems and counts; anyOf/oneOf/allOf, type lists, $refs.

A sentence is a walk over the grammar's token masks on a tokenizer, each next token drawn
at random from those allowed (short tokens favoured, so that strings end): what a model at
temperature 1 could write. Used by tests/structured/test_schema_fuzz.py and
benchmarks/schema_fuzz.py; run as a script it prints one grammar's tally as JSON, so that
vLLM's grammar is walked in vLLM's own venv (its xgrammar):

    python -m devtools.schema_fuzz --grammar vllm --tokenizer MODEL_DIR --schemas 300

Imports nothing of pdpool at the top: the vLLM venv does not have it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import jsonschema
import torch
import xgrammar as xgr

PATTERNS = (
    "^[a-z]+$", "[0-9]{2}", "^a|b$", r"^\d{1,3}(\.\d+)?$", "^(foo|bar)*$",
    r"^\w+@\w+\.com$", '^[^"]{0,4}$', "^.$", r"^\s*$", r"^\\x$", "^(ba+)?$", 'a"b',
    "^[^a]{1,3}(x[0-9]+)*$", r"^(\w+\.)+\w{2,}$", r"^\S\D\W$", r"^[\s\S]{0,3}$", '^\\\\[^"]$',
    "^(?:ab|c)+d?$", "^[A-Z]{2}-[0-9]{3}$", r"^\d+(,\d{3})*$",
)  # fmt: skip
KEY_PATTERNS = ("^p[0-9]$", "^(ba+)?$", '^q"', r"^[a-c]{1,2}(x\d+)?$")
FORMATS = (
    "date-time", "date", "time", "email", "uri", "uuid", "ipv4", "ipv6", "hostname",
    "duration", "uri-reference", "json-pointer", "relative-json-pointer",
)  # fmt: skip
KEYS = ("a", "b", "c d", "é", 'x"y', "n\\", "tab\t", "1", "ÿ")
ENUM_VALUES = (1, "x", None, True, 2.5, "a\nb", "é", {"a": 1}, [1, 2], -3, "", False)
NUMBERS = (0, 1, -1, 3, 10, 100, -5, 2.5, -0.5, 1e3, 0.1, 7, 1000000)


class SchemaMaker:
    """Random schemas from one seeded generator; $defs collected at the root."""

    def __init__(self, rng: random.Random, max_depth: int = 3) -> None:
        self.rng, self.max_depth = rng, max_depth
        self._defs: dict[str, Any] = {}

    def schema(self) -> dict[str, Any]:
        self._defs = {}
        root = self._node(0)
        if self._defs:
            root["$defs"] = self._defs
        return root

    def _node(self, depth: int) -> dict[str, Any]:
        kinds = ["string", "integer", "number", "boolean", "null", "enum", "const", "untyped"]
        if depth < self.max_depth:
            kinds += ["object", "array", "combination", "type_list", "ref", "beside"] * 2
        return getattr(self, "_" + self.rng.choice(kinds))(depth)

    def _string(self, depth: int) -> dict[str, Any]:
        r, node = self.rng, {"type": "string"}
        choice = r.random()
        if choice < 0.3:
            if r.random() < 0.7:
                node["minLength"] = r.choice([0, 1, 2, 5])
            if r.random() < 0.7:
                node["maxLength"] = r.choice([0, 1, 3, 8])
        elif choice < 0.55:
            node["pattern"] = r.choice(PATTERNS)
        elif choice < 0.7:
            node["format"] = r.choice(FORMATS)
        return node

    def _integer(self, depth: int, kind: str = "integer") -> dict[str, Any]:
        r, node = self.rng, {"type": kind}
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if r.random() < 0.3:
                value = r.choice(NUMBERS)
                node[key] = int(value) if kind == "integer" and r.random() < 0.7 else value
        if r.random() < 0.15:
            node["multipleOf"] = r.choice([2, 3, 5, 2.5])
        return node

    def _number(self, depth: int) -> dict[str, Any]:
        return self._integer(depth, "number")

    def _boolean(self, depth: int) -> dict[str, Any]:
        return {"type": "boolean"}

    def _null(self, depth: int) -> dict[str, Any]:
        return {"type": "null"}

    def _enum(self, depth: int) -> dict[str, Any]:
        return {"enum": self.rng.sample(ENUM_VALUES, self.rng.randint(1, 4))}

    def _const(self, depth: int) -> dict[str, Any]:
        return {"const": self.rng.choice([1, "x", None, {"k": [1, "z"]}, [True], 'q"', 0.5])}

    def _object(self, depth: int) -> dict[str, Any]:
        r, node = self.rng, {"type": "object"}
        count = r.randint(0, 3)
        props = {r.choice(KEYS) + str(i): self._node(depth + 1) for i in range(count)}
        if props or r.random() < 0.5:
            node["properties"] = props
        if props and r.random() < 0.6:
            node["required"] = r.sample(list(props), r.randint(0, len(props)))
        choice = r.random()
        if choice < 0.3:
            node["additionalProperties"] = False
        elif choice < 0.4:
            node["additionalProperties"] = self._node(depth + 1)
        elif choice < 0.5:
            node["patternProperties"] = {r.choice(KEY_PATTERNS): self._node(depth + 1)}
        elif choice < 0.55:
            node["propertyNames"] = {"pattern": r.choice(KEY_PATTERNS)}
        return self._counts(node, "Properties", 0.2, (2, 3))

    def _array(self, depth: int) -> dict[str, Any]:
        r, node = self.rng, {"type": "array"}
        choice = r.random()
        if choice < 0.6:
            node["items"] = self._node(depth + 1)
        elif choice < 0.8:
            node["prefixItems"] = [self._node(depth + 1) for _ in range(r.randint(1, 3))]
            if r.random() < 0.5:
                node["items"] = False if r.random() < 0.5 else self._node(depth + 1)
        return self._counts(node, "Items", 0.4, (3, 4))

    def _counts(
        self, node: dict[str, Any], what: str, chance: float, most: tuple[int, int]
    ) -> dict[str, Any]:
        """min<what> and max<what>, each with `chance`, up to `most` (min, max)."""
        for bound, top in zip(("min", "max"), most, strict=True):
            if self.rng.random() < chance:
                node[bound + what] = self.rng.randint(0, top)
        return node

    def _combination(self, depth: int) -> dict[str, Any]:
        branches = [self._node(depth + 1) for _ in range(self.rng.randint(1, 3))]
        return {self.rng.choice(["anyOf", "oneOf", "allOf"]): branches}

    def _untyped(self, depth: int) -> dict[str, Any]:
        """A type's keywords without `type`."""
        node = self._node(depth)
        node.pop("type", None)
        return node

    def _beside(self, depth: int) -> dict[str, Any]:
        """Constraints beside a combination, a $ref or an enum (type included)."""
        r = self.rng
        base = r.choice([self._combination, self._ref, self._enum, self._const])(depth)
        extra = r.choice([self._string, self._integer, self._object, self._array])(depth + 1)
        return {**extra, **base} if r.random() < 0.7 else {"type": extra["type"], **base}

    def _type_list(self, depth: int) -> dict[str, Any]:
        types = ["string", "integer", "number", "boolean", "null", "object", "array"]
        return {"type": self.rng.sample(types, self.rng.randint(1, 3))}

    def _ref(self, depth: int) -> dict[str, Any]:
        name = f"d{len(self._defs)}"
        self._defs[name] = {}  # reserved before the subschema takes its own names
        self._defs[name] = self._node(depth + 1)
        return {"$ref": f"#/$defs/{name}"}


def well_formed(schema: dict[str, Any]) -> bool:
    """A schema jsonschema itself takes (its metaschema)."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError:
        return False
    return True


def verdict(text: str, schema: dict[str, Any]) -> Optional[str]:
    """None for strict RFC 8259 JSON that validates; else why not."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    try:
        error = jsonschema.exceptions.best_match(
            jsonschema.validators.validator_for(schema)(schema).iter_errors(value)
        )
    except (ArithmeticError, ValueError) as exc:  # multipleOf of a number json reads as inf
        return f"invalid: jsonschema cannot judge it ({exc})"
    return None if error is None else f"invalid: {error.message}"


@dataclass
class Walker:
    """Random sentences of compiled grammars over one tokenizer's vocabulary."""

    tokenizer: Any
    vocab_size: int
    max_tokens: int = 200
    info: Any = field(init=False)
    compiler: Any = field(init=False)
    short_tokens: torch.Tensor = field(init=False)
    stop_tokens: torch.Tensor = field(init=False)
    _bit_shifts: torch.Tensor = field(init=False, default_factory=lambda: torch.arange(32))

    def __post_init__(self) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        lengths = [len(t) for t in self.info.decoded_vocab][: self.vocab_size]
        self.short_tokens = torch.tensor([n <= 1 for n in lengths])
        # a sentence ends when the walk says so, never on a stop token drawn at random
        self.stop_tokens = torch.zeros(self.vocab_size, dtype=torch.bool)
        self.stop_tokens[list(self.info.stop_token_ids)] = True

    def sentences(self, grammar: Any, rng: random.Random, count: int) -> list[str]:
        """Up to `count` sentences (walks that end within max_tokens); AssertionError if
        the grammar ever leaves no token to take (a dead end)."""
        compiled = self.compiler.compile_grammar(grammar)
        out = []
        for _ in range(count):
            tokens = self._walk(compiled, rng)
            if tokens is not None:
                out.append(self.tokenizer.decode(tokens))
        return out

    def _walk(self, compiled: Any, rng: random.Random) -> Optional[list[int]]:
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        tokens: list[int] = []
        while len(tokens) < self.max_tokens:
            if matcher.is_terminated() or (matcher.is_completed() and rng.random() < 0.5):
                return tokens
            matcher.fill_next_token_bitmask(bitmask)
            bits = (bitmask[0].unsqueeze(1) >> self._bit_shifts) & 1  # token 32i+j: word i, bit j
            allowed = bits.flatten()[: self.vocab_size].bool() & ~self.stop_tokens
            if not allowed.any():
                assert matcher.is_completed(), "the grammar left no token to take"
                return tokens
            short = allowed & self.short_tokens
            pool = short if short.any() and rng.random() < 0.8 else allowed
            choices = pool.nonzero().flatten().tolist()
            token = choices[rng.randrange(len(choices))]
            assert matcher.accept_token(token), "the grammar refused a token its mask allowed"
            tokens.append(token)
        return None


class OtherBackend(Exception):
    """A schema vLLM hands to another structured-output backend than xgrammar."""


def engine_grammar(compact: bool) -> Callable[[str], Any]:
    """The engine's grammar of a schema (its refusals raise, as the 400 they become)."""
    from pdpool.engine.structured.json_grammar import schema_grammar
    from pdpool.engine.structured.schema_support import check_supported

    def grammar_of(text: str) -> Any:
        check_supported(json.loads(text))
        return schema_grammar(text, compact)

    return grammar_of


def xgrammar_as_is(text: str) -> Any:
    """The installed xgrammar's own grammar, with free whitespace."""
    return xgr.Grammar.from_json_schema(text, any_whitespace=True)


def vllm_grammar(text: str) -> Any:
    """What vLLM's default `auto` backend compiles with xgrammar (its default whitespace);
    a schema it finds unsupported goes to another backend (OtherBackend)."""
    from vllm.v1.structured_output.backend_xgrammar import (
        has_xgrammar_unsupported_json_features,
    )

    if has_xgrammar_unsupported_json_features(json.loads(text)):
        raise OtherBackend
    return xgr.Grammar.from_json_schema(text, any_whitespace=True)


GRAMMARS: dict[str, Callable[[], Callable[[str], Any]]] = {
    "pdpool": lambda: engine_grammar(compact=False),
    "pdpool-compact": lambda: engine_grammar(compact=True),
    "xgrammar": lambda: xgrammar_as_is,
    "vllm": lambda: vllm_grammar,
}


@dataclass
class Tally:
    schemas: int = 0
    refused: int = 0
    other_backend: int = 0
    sentences: int = 0
    bad: list[tuple[str, str, str]] = field(default_factory=list)  # (why, text, schema)


def fuzz(
    walker: Walker,
    grammar_of: Callable[[str], Any],
    seed: int,
    schemas: int,
    walks: int,
) -> Tally:
    """`schemas` random well-formed schemas from `seed`, `walks` walks each through
    `grammar_of(schema text)` (None, or an exception, for a schema it refuses)."""
    rng = random.Random(seed)
    maker, tally = SchemaMaker(rng), Tally()
    while tally.schemas < schemas:
        schema = maker.schema()
        if not well_formed(schema):
            continue
        tally.schemas += 1
        text = json.dumps(schema)
        try:
            grammar = grammar_of(text)
        except OtherBackend:
            tally.other_backend += 1
            continue
        except Exception:  # a refusal: the engine answers 400
            grammar = None
        if grammar is None:
            tally.refused += 1
            continue
        for sentence in walker.sentences(grammar, rng, walks):
            tally.sentences += 1
            why = verdict(sentence, schema)
            if why is not None:
                tally.bad.append((why, sentence, text))
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grammar", choices=sorted(GRAMMARS), required=True)
    parser.add_argument("--tokenizer", required=True, help="a model folder with a tokenizer")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schemas", type=int, default=300)
    parser.add_argument("--walks", type=int, default=4)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    walker = Walker(AutoTokenizer.from_pretrained(args.tokenizer), args.vocab_size)
    tally = fuzz(walker, GRAMMARS[args.grammar](), args.seed, args.schemas, args.walks)
    json.dump(asdict(tally), sys.stdout)


if __name__ == "__main__":
    main()
