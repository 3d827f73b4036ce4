"""Weighted model rewrites, as the Gateway API Inference Extension's InferenceModelRewrite:
a request's `model` is replaced, before routing, by a target drawn by weight, so that a new
adapter version takes a share of its predecessor's traffic (canary / blue-green rollouts)
without clients changing the name they send.

The file (`--model-rewrites FILE`, YAML or JSON; re-read when it changes, a bad new file
keeps the last good rules) is GIE's object or just its rules, as the operator renders them
from spec.loras' `rollout` (operator/gie_adapters.py):

    rules:
      - matches: [{model: {type: Exact, value: sql}}]
        targets: [{modelRewrite: sql, weight: 90}, {modelRewrite: sql-v3, weight: 10}]

GIE's semantics: a rule matches the request's model exactly; a rule without `matches` is
the fallback for every model no other rule names (and a request that names none); targets
are drawn weighted-random. The rewritten model is in the body the engine gets, so routing
(adapter residency) sees the target, and the engine's answer names the target in its
`model` (GIE passes the response through as the model server wrote it).

Stricter than GIE where a file could only be a mistake (GIE reads objects that an API
server checked): a weight is an integer in [0, 1000000], every target of a rule has one or
none has (none: equal shares), a rule's weights may not sum to 0, a model is matched by
one rule at most, one fallback at most. A target the engines do not serve is not known
here: the engine answers 404 naming it (docs/lora.md).
"""

from __future__ import annotations

import bisect
import itertools
import json
import random
from dataclasses import dataclass
from typing import Any, Callable, Optional

import yaml

from ..net.reloading import ReloadingFile

MAX_FILE_BYTES = 1 << 20
MAX_RULES = 1024
MAX_TARGETS = 64
MAX_WEIGHT = 1_000_000  # GIE's bound on a target's weight
MAX_NAME = 256
FALLBACK = "*"  # the fallback rule's name in metrics


class RewriteError(ValueError):
    """The rewrite file cannot be used; the message names the field."""


@dataclass(frozen=True)
class Rule:
    matches: tuple[str, ...]  # exact model names; () for the fallback
    targets: tuple[str, ...]
    cumulative: tuple[int, ...]  # running sums of the targets' weights

    def draw(self, rand: Callable[[int], int]) -> str:
        """A target, weighted: `rand(n)` is uniform over [0, n)."""
        pick = rand(self.cumulative[-1])
        return self.targets[bisect.bisect_right(self.cumulative, pick)]


@dataclass(frozen=True)
class RewriteRules:
    by_model: dict[str, Rule]
    fallback: Optional[Rule] = None

    def rule_for(self, model: Optional[str]) -> tuple[Optional[Rule], str]:
        """The rule for a request's model and the name metrics give it."""
        rule = self.by_model.get(model) if model is not None else None
        if rule is not None:
            assert model is not None
            return rule, model
        return self.fallback, FALLBACK


def _name(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise RewriteError(f"{where}: a non-empty string is required")
    if len(value) > MAX_NAME or any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise RewriteError(
            f"{where}: at most {MAX_NAME} characters, no control characters ({value[:40]!r})"
        )
    return value


def _object(where: str, raw: Any, known: set[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise RewriteError(f"{where}: an object is required, not {type(raw).__name__}")
    extra = set(raw) - known
    if extra:
        raise RewriteError(f"{where}: unknown field(s) {sorted(map(str, extra))}")
    return raw


def _list(where: str, raw: Any, most: int, least: int = 0) -> list[Any]:
    if raw is None and least == 0:
        return []
    if not isinstance(raw, list) or not least <= len(raw) <= most:
        raise RewriteError(f"{where}: a list of {least} to {most} entries is required")
    return raw


def _match(where: str, raw: Any) -> str:
    model = _object(where, raw, {"model"}).get("model")
    m = _object(f"{where}.model", model, {"type", "value"})
    kind = m.get("type", "Exact")
    if kind != "Exact":
        raise RewriteError(f"{where}.model.type: only Exact is supported, not {kind!r}")
    return _name(f"{where}.model.value", m.get("value"))


def _weight(where: str, raw: Any) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= MAX_WEIGHT:
        raise RewriteError(f"{where}: an integer in [0, {MAX_WEIGHT}] is required, not {raw!r}")
    return raw


def _rule(where: str, raw: Any) -> Rule:
    r = _object(where, raw, {"matches", "targets"})
    matches = tuple(
        _match(f"{where}.matches[{i}]", m)
        for i, m in enumerate(_list(f"{where}.matches", r.get("matches"), MAX_RULES))
    )
    items = _list(f"{where}.targets", r.get("targets"), MAX_TARGETS, least=1)
    targets, weights = [], []
    for i, item in enumerate(items):
        t = _object(f"{where}.targets[{i}]", item, {"modelRewrite", "weight"})
        targets.append(_name(f"{where}.targets[{i}].modelRewrite", t.get("modelRewrite")))
        if "weight" in t:
            weights.append(_weight(f"{where}.targets[{i}].weight", t["weight"]))
    if len(set(targets)) != len(targets):
        raise RewriteError(f"{where}.targets: a target is named twice")
    if not weights:
        weights = [1] * len(targets)  # no weights: equal shares
    elif len(weights) != len(targets):
        raise RewriteError(f"{where}.targets: give every target a weight, or none")
    if sum(weights) == 0:
        raise RewriteError(f"{where}.targets: the weights sum to 0 (no target could be drawn)")
    return Rule(matches, tuple(targets), tuple(itertools.accumulate(weights)))


def parse_rewrites(text: str) -> RewriteRules:
    """The file's text -> its rules; RewriteError naming the bad field."""
    if len(text) > MAX_FILE_BYTES:
        raise RewriteError(f"the file exceeds {MAX_FILE_BYTES} bytes")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RewriteError(f"not valid YAML or JSON: {exc}") from None
    if isinstance(raw, dict) and "spec" in raw:  # a whole InferenceModelRewrite object
        if raw.get("kind", "InferenceModelRewrite") != "InferenceModelRewrite":
            raise RewriteError(f"kind: InferenceModelRewrite expected, not {raw.get('kind')!r}")
        where, raw = "spec", raw["spec"]
        top = _object(where, raw, {"rules", "poolRef"})
    else:
        where, top = "the file", _object("the file", raw, {"rules"})
    rules = [
        _rule(f"rules[{i}]", r)
        for i, r in enumerate(_list(f"{where}.rules", top.get("rules"), MAX_RULES, least=1))
    ]
    by_model: dict[str, Rule] = {}
    fallback: Optional[Rule] = None
    for i, rule in enumerate(rules):
        if not rule.matches:
            if fallback is not None:
                raise RewriteError(f"rules[{i}]: a second rule without matches (one fallback)")
            fallback = rule
        for model in rule.matches:
            if model in by_model:
                raise RewriteError(f"rules[{i}]: model {model!r} is matched by an earlier rule")
            by_model[model] = rule
    return RewriteRules(by_model, fallback)


def counted_rewrites(path: str, registry: Any) -> "ModelRewrites":
    """ModelRewrites whose decisions count in `registry`, under GIE's metric's labels."""
    from prometheus_client import Counter

    decisions = Counter(
        "pdpool_model_rewrite_decisions",
        "Requests whose model a rewrite rule replaced (model_name: the rule's model, "
        f"{FALLBACK!r} for the fallback rule)",
        ["model_name", "target_model"],
        registry=registry,
    )
    return ModelRewrites(path, lambda name, target: decisions.labels(name, target).inc())


class ModelRewrites:
    """The rules of a file, kept current, applied to request bodies."""

    def __init__(
        self,
        path: str,
        on_rewrite: Optional[Callable[[str, str], None]] = None,
        rand: Callable[[int], int] = random.randrange,
        recheck_s: float = 1.0,
    ) -> None:
        try:
            self._file = ReloadingFile(path, parse_rewrites, "model rewrites file", recheck_s)
        except (OSError, ValueError) as exc:  # a bad file at startup: a configuration error
            raise RewriteError(f"model rewrites file {path}: {exc}") from None
        self._on_rewrite = on_rewrite
        self._rand = rand

    def rules(self) -> RewriteRules:
        return self._file.current()

    def apply(self, body: Any, raw: bytes) -> tuple[Any, bytes]:
        """The body with its `model` rewritten when a rule applies (the bytes re-encoded),
        else both unchanged. Only a JSON object with a string (or no) model is rewritten."""
        if not isinstance(body, dict):
            return body, raw
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            return body, raw
        rule, name = self.rules().rule_for(model)
        if rule is None:
            return body, raw
        target = rule.draw(self._rand)
        if self._on_rewrite is not None:
            self._on_rewrite(name, target)
        if target == model:
            return body, raw
        body = {**body, "model": target}
        return body, json.dumps(body).encode()
