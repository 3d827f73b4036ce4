"""`spec.kvOffload`: the spec's checks, the engine flags (parsed by the real `pdpool serve`
CLI into a valid engine config) and the volume each backend mounts: an emptyDir per pod
sized a little above the tier (disk), or the pool's shared claim (shared)."""

import re

import pytest
import yaml

from pdpool.operator.kv_offload import KV_OFFLOAD_MOUNT
from pdpool.operator.spec import SpecError, parse_pool_spec
from tests.support.operator_pods import BASE, engine_config
from tests.support.operator_pods import engine_pods as pods


def test_disk_tier_is_an_emptydir_per_pod():
    spec = {**BASE, "kvOffload": {"backend": "disk", "sizeGiB": 20}}
    rendered = pods(spec)
    assert len(rendered) == 2  # prefill and decode engines
    for pod in rendered.values():
        config, engine = engine_config(pod)
        assert (config.kv_offloading_size, config.kv_offloading_backend) == (20.0, "disk")
        assert config.kv_offloading_path == KV_OFFLOAD_MOUNT and not config.kv_offloading_fsync
        assert {"name": "kv-offload", "mountPath": KV_OFFLOAD_MOUNT} in engine["volumeMounts"]
        volume = next(v for v in pod["volumes"] if v["name"] == "kv-offload")
        limit = volume["emptyDir"]["sizeLimit"]
        assert limit.endswith("Mi") and 20 * 1024 < int(limit[:-2]) < 23 * 1024


def test_shared_tier_mounts_the_pools_claim():
    spec = {
        **BASE,
        "kvOffload": {"backend": "shared", "sizeGiB": 100, "pvc": "kv-tier", "fsync": True},
    }
    for pod in pods(spec).values():
        config, _ = engine_config(pod)
        assert config.kv_offloading_backend == "shared" and config.kv_offloading_fsync
        volume = next(v for v in pod["volumes"] if v["name"] == "kv-offload")
        assert volume == {"name": "kv-offload", "persistentVolumeClaim": {"claimName": "kv-tier"}}


def test_no_tier_without_the_section():
    for pod in pods(BASE).values():
        config, _ = engine_config(pod)
        assert config.kv_offloading_size is None
        assert all(v["name"] != "kv-offload" for v in pod["volumes"])


@pytest.mark.parametrize(
    "section, fragment",
    [
        ({"backend": "disk"}, "sizeGiB must be a number"),
        ({"sizeGiB": 0}, "sizeGiB must be a number"),
        ({"sizeGiB": -1}, "sizeGiB must be a number"),
        ({"sizeGiB": "lots"}, "sizeGiB must be a number"),
        ({"sizeGiB": True}, "sizeGiB must be a number"),
        ({"sizeGiB": 1e12}, "sizeGiB must be a number"),
        ({"sizeGiB": 1, "backend": "lmcache"}, "backend must be one of native, disk, shared"),
        ({"sizeGiB": 1, "backend": "native", "pvc": "x"}, "pvc is for backend shared"),
        ({"sizeGiB": 1, "backend": "shared"}, "pvc is required"),
        ({"sizeGiB": 1, "backend": "shared", "pvc": ""}, "pvc is required"),
        ({"sizeGiB": 1, "pvc": "x"}, "pvc is for backend shared"),
        ({"sizeGiB": 1, "fsync": "yes"}, "fsync must be a boolean"),
        ("big", "must be an object"),
    ],
)
def test_bad_sections_are_refused_with_one_line(section, fragment):
    with pytest.raises(SpecError, match=re.escape(fragment)):
        parse_pool_spec("demo", {**BASE, "kvOffload": section})


def test_not_with_stock_vllm():
    spec = {**BASE, "engine": {"image": "vllm:1", "kind": "vllm"}, "kvOffload": {"sizeGiB": 1}}
    with pytest.raises(SpecError, match=r"not with spec\.engine\.kind vllm"):
        parse_pool_spec("demo", spec)


def test_crd_schema_describes_the_section():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    crd = yaml.safe_load((root / "crds" / "pdinferencepools.pdpool.io.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    section = schema["properties"]["kvOffload"]
    assert section["required"] == ["sizeGiB"]
    assert section["properties"]["backend"]["enum"] == ["native", "disk", "shared"]


def test_native_tier_needs_no_volume():
    spec = {**BASE, "kvOffload": {"backend": "native", "sizeGiB": 4}}
    for pod in pods(spec).values():
        config, engine = engine_config(pod)
        assert (config.kv_offloading_backend, config.kv_offloading_path) == ("native", None)
        assert all(v["name"] != "kv-offload" for v in pod["volumes"])
        assert all(m["name"] != "kv-offload" for m in engine["volumeMounts"])
