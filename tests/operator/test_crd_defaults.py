"""The CRD's `default:`s and the operator's are the same values.

The API server fills a CRD default into every pool it stores, and the operator fills its own
(operator/spec.py, pdpool/pool_defaults.py) where a field is absent (a spec rendered offline,
an older CRD): both must give the same pool. YAML cannot import Python, so the CRD keeps the
values for `kubectl explain` and the API server, and this test holds them equal: for every
`default:` in the schema, a spec that sets the field to it parses exactly as one that leaves
it out, and a spec that sets another value does not (the operator reads that field). Both
CRD copies are checked (tests/operator/test_operator_helm.py holds them byte-identical)."""

from __future__ import annotations

from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdpool.operator.spec import SpecError, parse_pool_spec

ROOT = Path(__file__).resolve().parents[2]
CRD_NAME = "pdinferencepools.pdpool.io.yaml"
CRDS = [ROOT / "crds" / CRD_NAME, ROOT / "charts" / "pdpool-operator" / "crds" / CRD_NAME]
MINIMAL = {"model": {"huggingFaceId": "org/model"}, "engine": {"image": "img:1"}}
# Sections that are absent unless given with these (an optional Secret names itself, an
# InferencePool is made when enabled, autoscaling needs each role's max): a default inside
# one is compared with the section given, the least the operator accepts.
SECTIONS: dict[tuple[str, ...], Any] = {
    ("engine", "kvSecretRef"): {"name": "kv"},
    ("gateway", "apiKeysSecret"): {"name": "keys"},
    ("gateway", "tenantsSecret"): {"name": "tenants"},
    ("inferencePool",): {"enabled": True},
    ("autoscaling",): {"prefill": {"max": 2}, "decode": {"max": 2}},
}


def spec_schema(path: Path) -> dict[str, Any]:
    crd = yaml.safe_load(path.read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def schema_defaults(schema: dict[str, Any], path: tuple[str, ...] = ()):
    """(path, default) of every `default:` under `schema`, outside lists."""
    if "default" in schema:
        yield path, schema["default"]
    for key, sub in (schema.get("properties") or {}).items():
        yield from schema_defaults(sub, (*path, key))


def schema_at(schema: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    for key in path:
        schema = schema["properties"][key]
    return schema


def with_value(spec: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = deepcopy(spec)
    node = out
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = deepcopy(value)
    return out


def base_for(path: tuple[str, ...]) -> dict[str, Any]:
    """The minimal spec, with the section around `path` when it needs one (not for a field
    the sample itself sets, such as the switch `inferencePool.enabled`: absent is its base)."""
    spec = deepcopy(MINIMAL)
    for section, least in SECTIONS.items():
        inner = path[len(section) :]
        if path[: len(section)] == section and inner:
            if len(inner) == 1 and inner[0] in least:
                continue
            spec = with_value(spec, section, {**least, **_get(spec, section)})
    return spec


def _get(spec: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    for key in path:
        spec = spec.get(key) or {}
    return spec


def another(schema: dict[str, Any], default: Any) -> Any:
    """A value of the field's type other than its default."""
    if "enum" in schema:
        return next(v for v in schema["enum"] if v != default)
    if isinstance(default, bool):
        return not default
    if schema.get("type") == "integer":
        return default + 2  # +1 would be kvEvents.port's replayPort
    if schema.get("type") == "number":
        return default * 0.5 if default else 0.25
    return f"{default}-other"


def parsed(spec: dict[str, Any]):
    return parse_pool_spec("pool", spec)


def drifted(schema: dict[str, Any]) -> list[str]:
    """The defaulted fields whose CRD default the operator does not give when absent."""
    wrong = []
    for path, default in schema_defaults(schema):
        base = base_for(path)
        if parsed(with_value(base, path, default)) != parsed(base):
            wrong.append(".".join(path))
    return wrong


def test_the_crd_has_defaults_and_every_section_sample_is_used():
    paths = [p for p, _ in schema_defaults(spec_schema(CRDS[0]))]
    assert len(paths) >= 40
    for section in SECTIONS:
        assert any(p[: len(section)] == section and p != section for p in paths), section


@pytest.mark.parametrize("crd", CRDS, ids=["crds", "chart"])
def test_every_crd_default_is_the_operators(crd):
    """A pool that spells out a CRD default parses as one that leaves it out."""
    wrong = drifted(spec_schema(crd))
    assert not wrong, f"the CRD's default differs from the operator's: {wrong}"


def test_the_operator_reads_every_defaulted_field():
    """...and a different value changes the pool (or is refused): the operator reads that
    field, under that name, so the equality above is not vacuous."""
    schema = spec_schema(CRDS[0])
    unread = []
    for path, default in schema_defaults(schema):
        base = base_for(path)
        try:
            changed = parsed(with_value(base, path, another(schema_at(schema, path), default)))
        except SpecError:
            continue  # refused: read, and checked
        if changed == parsed(base):
            unread.append(".".join(path))
    assert not unread, f"the operator ignores these defaulted fields: {unread}"


def test_a_drifted_default_is_caught():
    """The comparison fails on a CRD whose default differs from the operator's."""
    schema = spec_schema(CRDS[0])
    schema_at(schema, ("router", "prefillTimeoutSeconds"))["default"] = 60
    schema_at(schema, ("engine", "blockSize"))["default"] = 32
    assert drifted(schema) == ["engine.blockSize", "router.prefillTimeoutSeconds"]
