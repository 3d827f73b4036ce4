"""spec.gateway.tenantsSecret: the tenants file (flow control) mounted in the gateway from
a Secret and passed as --tenants-file, which the gateway's own parser accepts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from pdpool.operator.builders import build_children
from pdpool.operator.children import PoolRef
from pdpool.operator.spec import SpecError, parse_pool_spec
from pdpool.sidecar.gateway.cli import add_arguments

ROOT = Path(__file__).resolve().parents[2]
REF = PoolRef(name="demo", namespace="llm", uid="uid-123")
HF = {
    "model": {"huggingFaceId": "Qwen/Qwen3-0.6B"},
    "engine": {"image": "engine:1"},
    "router": {"image": "slim:1"},
}


def gateway_pod(spec, name="demo-gateway"):
    for m in build_children(REF, parse_pool_spec(REF.name, spec)):
        if m["kind"] == "Deployment" and m["metadata"]["name"] == name:
            return m["spec"]["template"]["spec"]
    raise AssertionError(f"no Deployment {name}")


def test_the_tenants_secret_becomes_the_gateways_tenants_file():
    pod = gateway_pod(dict(HF, gateway={"tenantsSecret": {"name": "llm-tenants"}}))
    gateway = pod["containers"][0]
    argv = gateway["command"]
    assert argv[argv.index("--tenants-file") + 1] == "/etc/pdpool/tenants/tenants.yaml"
    assert "--api-keys-file" not in argv
    assert {"name": "tenants", "mountPath": "/etc/pdpool/tenants", "readOnly": True} in gateway[
        "volumeMounts"
    ]
    assert {
        "name": "tenants",
        "secret": {
            "secretName": "llm-tenants",
            "defaultMode": 0o444,
            "items": [{"key": "tenants.yaml", "path": "tenants.yaml"}],
        },
    } in pod["volumes"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv[2:])  # after `pdpool gateway`
    assert args.tenants_file == "/etc/pdpool/tenants/tenants.yaml"
    other_key = gateway_pod(dict(HF, gateway={"tenantsSecret": {"name": "t", "key": "flow"}}))
    assert other_key["volumes"][-1]["secret"]["items"] == [{"key": "flow", "path": "tenants.yaml"}]
    plain = gateway_pod(HF)["containers"][0]["command"]
    assert "--tenants-file" not in plain


def test_the_endpoint_picker_gets_the_same_tenants_file():
    gie = {"enabled": True, "gatewayRefs": [{"name": "inference-gateway"}]}
    spec = dict(HF, gateway={"tenantsSecret": {"name": "llm-tenants"}}, inferencePool=gie)
    names = [
        m["metadata"]["name"]
        for m in build_children(REF, parse_pool_spec(REF.name, spec))
        if m["kind"] == "Deployment"
    ]
    epp = next(n for n in names if n.endswith("epp"))
    pod = gateway_pod(spec, epp)
    argv = pod["containers"][0]["command"]
    assert argv[argv.index("--tenants-file") + 1] == "/etc/pdpool/tenants/tenants.yaml"
    assert any(v["name"] == "tenants" for v in pod["volumes"])
    from pdpool.sidecar.epp.cli import add_arguments as epp_arguments

    parser = argparse.ArgumentParser()
    epp_arguments(parser)
    assert parser.parse_args(argv[2:]).tenants_file == "/etc/pdpool/tenants/tenants.yaml"


def test_tenants_and_api_keys_secrets_are_exclusive():
    both = {"tenantsSecret": {"name": "t"}, "apiKeysSecret": {"name": "k"}}
    with pytest.raises(SpecError, match="not both"):
        parse_pool_spec("demo", dict(HF, gateway=both))
    with pytest.raises(SpecError, match=r"tenantsSecret\.name"):
        parse_pool_spec("demo", dict(HF, gateway={"tenantsSecret": {}}))


def test_the_crd_declares_the_tenants_secret():
    crd = yaml.safe_load((ROOT / "crds" / "pdinferencepools.pdpool.io.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    gateway = schema["properties"]["spec"]["properties"]["gateway"]["properties"]
    assert gateway["tenantsSecret"]["required"] == ["name"]
    assert gateway["tenantsSecret"]["properties"]["key"]["default"] == "tenants.yaml"
