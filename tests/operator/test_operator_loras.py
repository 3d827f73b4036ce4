"""`spec.loras`: the spec's checks, the LoRA flags every engine gets (parsed by the real
`pdpool serve` CLI into a valid engine config), and the claims mounted read-only."""

import re

import pytest

from pdpool.cli import build_parser
from pdpool.operator.builders import build_children
from pdpool.operator.children import PoolRef
from pdpool.operator.loras import LORA_MOUNT
from pdpool.operator.spec import SpecError, parse_pool_spec

REF = PoolRef(name="demo", namespace="llm", uid="uid-123")
BASE = {"model": {"path": "/models/qwen3"}, "engine": {"image": "engine:1"}}


def engine_pods(spec):
    out = {}
    for m in build_children(REF, parse_pool_spec(REF.name, spec)):
        if m["kind"] == "Deployment" and "engine" in [
            c["name"] for c in m["spec"]["template"]["spec"]["containers"]
        ]:
            out[m["metadata"]["name"]] = m["spec"]["template"]["spec"]
    return out


def engine_config(pod):
    from pdpool.engine.serve_cli import config_from_args

    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    env = {"POD_IP": "10.1.2.3"}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in engine["command"]]
    return config_from_args(build_parser().parse_args(argv[1:])), engine


def test_both_roles_serve_the_same_adapters():
    spec = {
        **BASE,
        "loras": {
            "maxLoras": 2,
            "maxRank": 32,
            "adapters": [
                {"name": "support", "pvc": "adapters", "subPath": "support"},
                {"name": "legal", "path": "/models/adapters/legal"},
            ],
        },
    }
    pods = engine_pods(spec)
    assert len(pods) == 2  # prefill and decode
    for pod in pods.values():
        config, engine = engine_config(pod)
        assert config.enable_lora and (config.max_loras, config.max_lora_rank) == (2, 32)
        assert config.lora_modules == [
            f"support={LORA_MOUNT}/support",
            "legal=/models/adapters/legal",
        ]
        mount = next(m for m in engine["volumeMounts"] if m["name"] == "lora-support")
        assert mount == {
            "name": "lora-support",
            "mountPath": f"{LORA_MOUNT}/support",
            "readOnly": True,
            "subPath": "support",
        }
        volume = next(v for v in pod["volumes"] if v["name"] == "lora-support")
        assert volume["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
        assert not [v for v in pod["volumes"] if v["name"] == "lora-legal"]


def test_no_lora_without_the_section():
    for pod in engine_pods(BASE).values():
        config, _ = engine_config(pod)
        assert not config.enable_lora and config.lora_modules == []


@pytest.mark.parametrize(
    "section, fragment",
    [
        ([], "must be an object"),
        ({}, "must list 1 to"),
        ({"adapters": []}, "must list 1 to"),
        ({"adapters": ["a"]}, "must be an object"),
        ({"adapters": [{"name": "a"}]}, "exactly one of path or pvc"),
        ({"adapters": [{"name": "a", "path": "/x", "pvc": "c"}]}, "exactly one of path or pvc"),
        ({"adapters": [{"name": "a", "path": "rel"}]}, "absolute path"),
        ({"adapters": [{"name": "a b", "path": "/x"}]}, "name must be"),
        ({"adapters": [{"name": "a=b", "path": "/x"}]}, "name must be"),
        ({"adapters": [{"name": "a", "pvc": "c", "subPath": "../etc"}]}, "subPath"),
        ({"adapters": [{"name": "a", "path": "/x", "subPath": "s"}]}, "subPath"),
        ({"adapters": [{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}]}, "unique"),
        ({"adapters": [{"name": "a", "path": "/x"}], "maxLoras": 0}, "maxLoras"),
        ({"adapters": [{"name": "a", "path": "/x"}], "maxRank": True}, "maxRank"),
        ({"adapters": [{"name": f"a{i}", "path": "/x"} for i in range(65)]}, "must list 1 to"),
    ],
)
def test_bad_sections_are_refused(section, fragment):
    with pytest.raises(SpecError, match=re.escape(fragment)):
        parse_pool_spec(REF.name, {**BASE, "loras": section})


def test_crd_schema_describes_the_section():
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    for path in (root / "crds", root / "charts" / "pdpool-operator" / "crds"):
        crd = yaml.safe_load((path / "pdinferencepools.pdpool.io.yaml").read_text())
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        section = schema["properties"]["loras"]
        assert section["required"] == ["adapters"]
        item = section["properties"]["adapters"]["items"]
        assert set(item["properties"]) == {"name", "path", "pvc", "subPath"}
