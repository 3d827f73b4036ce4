"""GIE's weighted model rewrites (sidecar/routing/model_rewrite.py): the rules a file gives,
the weighted draw, and every file that must be refused with the field named."""

from __future__ import annotations

import collections
import json
import random
import time

import pytest
import yaml

from pdpool.sidecar.routing.model_rewrite import (
    MAX_WEIGHT,
    ModelRewrites,
    RewriteError,
    parse_rewrites,
)

ROLLOUT = """
rules:
  - matches: [{model: {type: Exact, value: sql}}]
    targets: [{modelRewrite: sql, weight: 90}, {modelRewrite: sql-v3, weight: 10}]
"""


def rule(targets, matches=(("sql",))):
    return {
        "matches": [{"model": {"type": "Exact", "value": m}} for m in matches],
        "targets": targets,
    }


def text(*rules) -> str:
    return yaml.safe_dump({"rules": list(rules)})


def test_a_rollout_splits_by_weight():
    rules = parse_rewrites(ROLLOUT)
    r, name = rules.rule_for("sql")
    assert name == "sql" and r is not None
    rng = random.Random(1)
    counts = collections.Counter(r.draw(rng.randrange) for _ in range(20_000))
    assert set(counts) == {"sql", "sql-v3"}
    assert 0.08 < counts["sql-v3"] / 20_000 < 0.12
    assert rules.rule_for("other") == (None, "*")


def test_the_draw_covers_each_target_for_exactly_its_weight():
    weighted = [
        {"modelRewrite": "a", "weight": 2},
        {"modelRewrite": "b", "weight": 0},
        {"modelRewrite": "c", "weight": 1},
    ]
    r, _ = parse_rewrites(text(rule(weighted))).rule_for("sql")
    assert r is not None
    assert [r.draw(lambda n, i=i: i) for i in range(3)] == ["a", "a", "c"]


def test_operator_object_and_json_are_read():
    obj = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceModelRewrite",
        "metadata": {"name": "p-adapters"},
        "spec": {"poolRef": {"name": "p"}, "rules": yaml.safe_load(ROLLOUT)["rules"]},
    }
    for doc in (yaml.safe_dump(obj), json.dumps(obj)):
        assert parse_rewrites(doc).rule_for("sql")[0] is not None


def test_no_weights_are_equal_shares_and_a_rule_without_matches_is_the_fallback():
    rules = parse_rewrites(text(rule([{"modelRewrite": "a"}, {"modelRewrite": "b"}], ())))
    fallback, name = rules.rule_for("anything")
    assert name == "*" and fallback is not None
    assert rules.rule_for(None)[0] is fallback  # a request naming no model
    assert fallback.cumulative == (1, 2)


def test_apply_rewrites_the_body_and_its_bytes(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(text(rule([{"modelRewrite": "sql-v3", "weight": 1}])))
    seen = []
    rw = ModelRewrites(str(path), on_rewrite=lambda n, t: seen.append((n, t)))
    raw = b'{"model": "sql", "prompt": "x"}'
    body, out = rw.apply(json.loads(raw), raw)
    assert body["model"] == "sql-v3" and json.loads(out) == body and seen == [("sql", "sql-v3")]
    other = b'{"model": "beta", "prompt": "x"}'
    assert rw.apply(json.loads(other), other)[1] is other
    assert rw.apply([1, 2], b"[1, 2]") == ([1, 2], b"[1, 2]")  # not an object: untouched
    assert rw.apply({"model": 7}, b"x") == ({"model": 7}, b"x")  # the engine refuses it


BAD = {
    "weights sum to 0": (
        text(rule([{"modelRewrite": "a", "weight": 0}, {"modelRewrite": "b", "weight": 0}])),
        "sum to 0",
    ),
    "negative weight": (text(rule([{"modelRewrite": "a", "weight": -1}])), "weight"),
    "huge weight": (text(rule([{"modelRewrite": "a", "weight": MAX_WEIGHT + 1}])), "weight"),
    "float weight": (text(rule([{"modelRewrite": "a", "weight": 0.5}])), "weight"),
    "bool weight": (text(rule([{"modelRewrite": "a", "weight": True}])), "weight"),
    "string weight": (text(rule([{"modelRewrite": "a", "weight": "90"}])), "weight"),
    "mixed weights": (
        text(rule([{"modelRewrite": "a", "weight": 1}, {"modelRewrite": "b"}])),
        "every target a weight",
    ),
    "no targets": (text(rule([])), "targets"),
    "empty target": (text(rule([{"modelRewrite": ""}])), "modelRewrite"),
    "control characters": (text(rule([{"modelRewrite": "a\nb"}])), "control"),
    "long name": (text(rule([{"modelRewrite": "a" * 300}])), "256"),
    "duplicate target": (text(rule([{"modelRewrite": "a"}, {"modelRewrite": "a"}])), "twice"),
    "model in two rules": (
        text(rule([{"modelRewrite": "a"}]), rule([{"modelRewrite": "b"}])),
        "earlier rule",
    ),
    "two fallbacks": (
        text(rule([{"modelRewrite": "a"}], ()), rule([{"modelRewrite": "b"}], ())),
        "fallback",
    ),
    "regex match": (
        yaml.safe_dump(
            {
                "rules": [
                    {
                        "matches": [{"model": {"type": "RegularExpression", "value": ".*"}}],
                        "targets": [{"modelRewrite": "a"}],
                    }
                ]
            }
        ),
        "only Exact",
    ),
    "unknown field": (
        yaml.safe_dump({"rules": [{"targets": [{"modelRewrite": "a", "wieght": 1}]}]}),
        "unknown field",
    ),
    "malformed YAML": ("rules: [ {", "not valid YAML"),
    "not a mapping": ("- a\n- b\n", "object is required"),
    "empty file": ("", "object is required"),
    "no rules": ("rules: []\n", "rules"),
    "other kind": (yaml.safe_dump({"kind": "InferencePool", "spec": {}}), "InferenceModelRewrite"),
    "huge file": ("#" * (2 << 20), "exceeds"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_files_are_refused_naming_why(case):
    doc, why = BAD[case]
    with pytest.raises(RewriteError, match=why):
        parse_rewrites(doc)


def test_a_bad_file_at_startup_is_a_configuration_error_and_a_bad_reload_keeps_the_rules(
    tmp_path,
):
    path = tmp_path / "rules.yaml"
    path.write_text("rules: [")
    with pytest.raises(RewriteError, match=r"model rewrites file .*not valid YAML"):
        ModelRewrites(str(path))
    with pytest.raises(RewriteError, match="No such file"):
        ModelRewrites(str(tmp_path / "missing.yaml"))
    path.write_text(ROLLOUT)
    rw = ModelRewrites(str(path), recheck_s=0.0)

    def targets_after_reload() -> set[str]:
        for _ in range(4):  # seen, then settled for settle_s, then taken or refused
            rw.rules()
            time.sleep(0.15)
        r = rw.rules().rule_for("sql")[0]
        assert r is not None
        return set(r.targets)

    path.write_text(text(rule([{"modelRewrite": "a", "weight": -5}])))
    assert targets_after_reload() == {"sql", "sql-v3"}  # refused: the last good rules stay
    path.write_text(text(rule([{"modelRewrite": "sql-v4", "weight": 5}])))
    assert targets_after_reload() == {"sql-v4"}
