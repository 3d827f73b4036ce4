"""Each guided request's grammar in the engine core: compiled once per spec (xgrammar's
compiler caches, bounded in bytes: least recently used grammars leave first), a matcher per
request that accepts the tokens it samples. Compiles run off the admission path
(compile_jobs.py); the add then gets the compiled grammar, not a second compile.

xgrammar is vLLM's default structured-output backend: the same masks for the same request,
so greedy guided outputs match stock vLLM's token for token, except where a JSON schema's
grammar is corrected (json_grammar.py: no control characters in strings, bounded blanks).
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import xgrammar as xgr

from pdpool.engine.outputs import RequestRejected
from pdpool.engine.structured.json_grammar import schema_grammar
from pdpool.engine.structured.spec import GuidedSpec
from pdpool.engine.structured.utf8_guard import START, Utf8Guard


class GuidedDecodingError(RequestRejected):
    """A spec that cannot be compiled, or prefix tokens the grammar refuses (answered 400)."""


class RequestGrammar:
    """One request's position in its grammar, and in a UTF-8 character (utf8_guard.py)."""

    __slots__ = ("guard", "matcher", "terminated", "utf8_state")

    def __init__(self, matcher: Any, guard: Optional[Utf8Guard] = None) -> None:
        self.matcher = matcher
        self.terminated = False
        self.guard = guard
        self.utf8_state = START

    def accept(self, token: int) -> bool:
        """Advances over a sampled token; False if the grammar does not allow it."""
        if self.terminated:
            return True
        if not self.matcher.accept_token(token):
            return False
        self.terminated = self.matcher.is_terminated()
        if self.guard is not None:
            self.utf8_state = self.guard.next_state(self.utf8_state, token)
        return True


# What compiled grammars may hold in memory (xgrammar's default, -1, has no bound: every
# distinct spec a client ever sent would stay).
DEFAULT_CACHE_BYTES = 256 << 20


class GrammarCompiler:
    """Compiles specs against the model's vocabulary (scanned once, in the background from
    start-up on)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, cache_limit_bytes: int = DEFAULT_CACHE_BYTES
    ) -> None:
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self.cache_limit_bytes = cache_limit_bytes
        self._compiler: Any = None
        self.guard: Optional[Utf8Guard] = None
        self._lock = threading.Lock()
        # Reading a large vocabulary takes a second or two: done at start-up, off the step
        # loop, so that the first guided request does not stall every stream.
        threading.Thread(target=self._get, name="pdpool-grammar-vocab", daemon=True).start()

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size
                )
                self.guard = Utf8Guard(info.decoded_vocab, self.vocab_size)
                self._compiler = xgr.GrammarCompiler(
                    info,
                    max_threads=2,
                    cache_enabled=True,
                    cache_limit_bytes=self.cache_limit_bytes,
                )
            return self._compiler

    def cache_size_bytes(self) -> int:
        return int(self._get().get_cache_size_bytes())

    def compile(self, spec: GuidedSpec) -> Any:
        compiler = self._get()
        try:
            return _compile(compiler, spec)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with a reason
            raise GuidedDecodingError(f"the {_what(spec)} cannot be compiled: {exc}") from exc

    def grammar_for(
        self, spec: GuidedSpec, stop_token_ids: list[int], compiled: Optional[Any] = None
    ) -> RequestGrammar:
        """A fresh matcher for one request, advanced over the spec's prefix tokens; `compiled`
        is the spec's grammar when it was compiled already (else it compiles here)."""
        if compiled is None:
            compiled = self.compile(spec)
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        self._get()  # the vocabulary and its UTF-8 guard, read once
        grammar = RequestGrammar(matcher, self.guard)
        for i, token in enumerate(spec.prefix_token_ids):
            if not grammar.accept(token):
                raise GuidedDecodingError(
                    f"the already generated token {token} (position {i}) does not match "
                    f"the {_what(spec)}"
                )
        return grammar


def _compile(compiler: Any, spec: GuidedSpec) -> Any:
    # any_whitespace as vLLM's default (unless the request asks for compact JSON).
    if spec.kind in ("json", "json_object"):
        schema = spec.value if spec.kind == "json" else '{"type": "object"}'
        return compiler.compile_grammar(schema_grammar(schema, spec.compact))
    if spec.kind == "regex":
        return compiler.compile_regex(spec.value)
    if spec.kind == "grammar":
        if _looks_like_lark(spec.value):
            return compiler.compile_lark(spec.value)
        return compiler.compile_grammar(spec.value)
    raise ValueError(f"unknown kind {spec.kind!r}")


def _looks_like_lark(grammar: str) -> bool:
    """EBNF rules say `::=`; Lark's say `:` (vLLM's grammar_is_likely_lark, simplified)."""
    return "::=" not in grammar


def _what(spec: GuidedSpec) -> str:
    return {
        "json": "JSON schema",
        "json_object": "JSON object grammar",
        "regex": "regex",
        "grammar": "grammar",
    }.get(spec.kind, "structured output")


def stop_ids_of(eos_token_ids: tuple[int, ...], stop_token_ids: list[int]) -> list[int]:
    return list(dict.fromkeys([*eos_token_ids, *stop_token_ids]))
