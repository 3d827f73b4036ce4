"""What a request's output must match, in engine terms; no heavy imports (the HTTP process
builds it, the engine core compiles it).

One kind per request, as vLLM: a JSON Schema (`json`), any JSON object (`json_object`), a
regular expression (`regex`), or a grammar (`grammar`: EBNF as xgrammar reads it, or Lark).
`guided_choice` becomes a grammar of its alternatives, as vLLM builds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

KINDS = ("json", "json_object", "regex", "grammar")


@dataclass(frozen=True)
class GuidedSpec:
    kind: str  # one of KINDS
    value: str  # the schema as JSON text, the regex, or the grammar; "" for json_object
    # Tokens already generated under this spec (a migrated stream's continuation): the last
    # tokens of the prompt; the engine advances the grammar over them before sampling.
    prefix_token_ids: tuple[int, ...] = ()
    # JSON without free whitespace between tokens (vLLM's disable_any_whitespace).
    compact: bool = False


def json_schema_spec(schema: Any, compact: bool = False) -> GuidedSpec:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return GuidedSpec("json", text, compact=compact)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are `choices` (vLLM's choice_as_grammar)."""
    return "root ::= " + " | ".join(f'"{_ebnf_escape(c)}"' for c in choices)


def _ebnf_escape(text: str) -> str:
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}
    out = []
    for ch in text:
        if ch in escapes:
            out.append(escapes[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def with_prefix(spec: Optional[GuidedSpec], prefix: list[int]) -> Optional[GuidedSpec]:
    if spec is None or not prefix:
        return spec
    return GuidedSpec(spec.kind, spec.value, tuple(prefix), spec.compact)
