"""The pure builders: what each child looks like for a given spec."""

import json

import pytest

from pdpool.operator import commands
from pdpool.operator.builders import build_children, data_hash
from pdpool.operator.children import PoolRef
from pdpool.operator.pool_secrets import kv_secret
from pdpool.operator.names import ANNOTATION_ROUTER_HASH
from pdpool.operator.spec import parse_pool_spec

REF = PoolRef(name="demo", namespace="llm", uid="uid-123")
BASE = {
    "model": {"path": "/models/qwen3"},
    "engine": {"image": "engine:1"},
    "router": {"image": "slim:1"},
}


def children(spec=None, ref=REF):
    return {
        (m["kind"], m["metadata"]["name"]): m
        for m in build_children(ref, parse_pool_spec(ref.name, spec or BASE))
    }


def container(deployment, name):
    return next(
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name
    )


def env_map(c):
    return {e["name"]: e for e in c["env"]}


def test_every_child_is_owned_by_the_pool_and_labelled():
    kids = children()
    assert set(kids) == {
        ("ConfigMap", "demo-router"),
        ("Service", "demo-prefill"),
        ("Service", "demo-decode"),
        ("Service", "demo-gateway"),
        ("Deployment", "demo-prefill"),
        ("Deployment", "demo-decode"),
        ("Deployment", "demo-gateway"),
        ("PodDisruptionBudget", "demo-prefill"),
        ("PodDisruptionBudget", "demo-decode"),
        ("PodDisruptionBudget", "demo-gateway"),
        ("NetworkPolicy", "demo-engines"),
        ("NetworkPolicy", "demo-decode-sidecar"),
        ("NetworkPolicy", "demo-gateway"),
    }
    for manifest in kids.values():
        meta = manifest["metadata"]
        assert meta["namespace"] == "llm"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "pdpool.io/v1alpha1",
                "kind": "PDInferencePool",
                "name": "demo",
                "uid": "uid-123",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"]["pdpool.io/pool"] == "demo"


def test_deployment_selectors_match_their_pod_labels_and_services():
    kids = children()
    for role in ("prefill", "decode", "gateway"):
        dep = kids[("Deployment", f"demo-{role}")]
        selector = dep["spec"]["selector"]["matchLabels"]
        assert selector == {"pdpool.io/pool": "demo", "pdpool.io/role": role}
        assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        assert kids[("Service", f"demo-{role}")]["spec"]["selector"] == selector


def test_prefill_and_decode_discovery_services_are_headless():
    kids = children()
    assert kids[("Service", "demo-prefill")]["spec"]["clusterIP"] == "None"
    assert kids[("Service", "demo-decode")]["spec"]["clusterIP"] == "None"
    gateway = kids[("Service", "demo-gateway")]["spec"]
    assert "clusterIP" not in gateway and gateway["type"] == "ClusterIP"
    assert gateway["ports"] == [
        {"name": "http", "port": 8080, "targetPort": 8080, "protocol": "TCP"}
    ]


def test_pdpool_engine_command_advertises_the_pod_ip():
    kids = children(dict(BASE, router={"cacheHitThreshold": 0.7, "image": "slim:1"}))
    prefill = container(kids[("Deployment", "demo-prefill")], "engine")
    decode = container(kids[("Deployment", "demo-decode")], "engine")
    argv = prefill["command"]
    assert argv[:3] == ["pdpool", "serve", "/models/qwen3"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--kv-host"] == "$(POD_IP)" and flags["--kv-role"] == "producer"
    assert flags["--host"] == "0.0.0.0" and flags["--kv-port"] == "5600"
    assert flags["--global-cache-hit-threshold"] == "0"
    # Default peers: the pool's own pods (its headless Services), not the private ranges.
    assert flags["--kv-peer-allowlist"] == "demo-prefill.llm.svc,demo-decode.llm.svc"
    decode_flags = dict(zip(decode["command"][3::2], decode["command"][4::2], strict=False))
    assert decode_flags["--kv-role"] == "consumer"
    assert decode_flags["--global-cache-hit-threshold"] == "0.7"
    pod_ip = env_map(prefill)["POD_IP"]
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert [e["name"] for e in prefill["env"]].index("POD_IP") == 0  # before any $(POD_IP)


def test_vllm_engine_gets_stock_vllm_flags_and_nixl_env():
    spec = dict(
        BASE,
        engine={"image": "vllm:1", "kind": "vllm"},
        decode={"gpus": 2, "tensorParallelSize": 2},
        model={"huggingFaceId": "Qwen/Qwen3-0.6B"},
    )
    decode = container(children(spec)[("Deployment", "demo-decode")], "engine")
    argv = decode["command"]
    assert argv[:3] == ["vllm", "serve", "/models/Qwen/Qwen3-0.6B"]
    i = argv.index("--kv-transfer-config")
    assert json.loads(argv[i + 1]) == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--served-model-name") + 1] == "Qwen/Qwen3-0.6B"
    env = env_map(decode)
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
    assert decode["resources"] == {
        "limits": {"nvidia.com/gpu": 2},
        "requests": {"nvidia.com/gpu": 2},
    }
    # stock vLLM ignores cache_hit_threshold: its sidecars decide P/D by prompt length
    assert children(spec)[("ConfigMap", "demo-router")]["data"]["engineRejects"] == "no"


def test_hugging_face_model_is_fetched_by_an_init_container():
    spec = dict(BASE, model={"huggingFaceId": "Qwen/Qwen3-0.6B", "hfTokenSecret": "hf"})
    pod = children(spec)[("Deployment", "demo-prefill")]["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    assert init["command"][3:5] == ["Qwen/Qwen3-0.6B", "/models/Qwen/Qwen3-0.6B"]
    assert env_map(init)["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert {"name": "models", "emptyDir": {}} in pod["volumes"]
    engine_mount = container({"spec": {"template": {"spec": pod}}}, "engine")["volumeMounts"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in engine_mount


def test_pvc_model_is_mounted_read_only():
    spec = dict(BASE, model={"path": "qwen3", "pvc": "weights"})
    pod = children(spec)[("Deployment", "demo-decode")]["spec"]["template"]["spec"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "weights"}} in pod["volumes"]
    engine = container({"spec": {"template": {"spec": pod}}}, "engine")
    assert engine["command"][2] == "/models/qwen3"
    assert "initContainers" not in pod


def test_decode_pod_has_the_sidecar_reading_the_router_config_map():
    kids = children()
    decode = kids[("Deployment", "demo-decode")]
    sidecar = container(decode, "sidecar")
    assert sidecar["image"] == "slim:1"
    argv = sidecar["command"]
    assert argv[:2] == ["pdpool", "sidecar"]
    flags = dict(zip(argv[2::2], argv[3::2], strict=False))
    assert flags["--host"] == "0.0.0.0" and flags["--port"] == "8080"
    assert flags["--decode-url"] == "http://127.0.0.1:8000"
    config = kids[("ConfigMap", "demo-router")]["data"]
    env = env_map(sidecar)
    for flag, key in [
        ("--mode", "mode"),
        ("--cache-hit-threshold", "cacheHitThreshold"),
        ("--prefill-service", "prefillService"),
        ("--kv-pull-threshold", "kvPullThreshold"),
        ("--prefill-timeout", "prefillTimeoutSeconds"),
        ("--engine-rejects", "engineRejects"),
    ]:
        var = commands.ROUTER_ENV[key]
        assert flags[flag] == f"$({var})"
        assert env[var]["valueFrom"]["configMapKeyRef"] == {"name": "demo-router", "key": key}
        assert key in config
    assert config["prefillService"] == "demo-prefill.llm.svc:8000"
    assert config["engineRejects"] == "yes"  # pdpool engines reject (decode-first as is)
    prefill_pod = kids[("Deployment", "demo-prefill")]["spec"]["template"]["spec"]
    assert "sidecar" not in [c["name"] for c in prefill_pod["containers"]]


def test_router_change_rolls_decode_and_gateway_pods_but_not_prefill():
    before = children()
    after = children(dict(BASE, router={"cacheHitThreshold": 0.9, "image": "slim:1"}))

    def annotation(kids, role):
        meta = kids[("Deployment", f"demo-{role}")]["spec"]["template"]["metadata"]
        return meta.get("annotations", {}).get(ANNOTATION_ROUTER_HASH)

    assert annotation(before, "decode") == data_hash(before[("ConfigMap", "demo-router")]["data"])
    assert annotation(before, "decode") != annotation(after, "decode")
    assert annotation(before, "gateway") != annotation(after, "gateway")
    assert after[("ConfigMap", "demo-router")]["data"]["cacheHitThreshold"] == "0.9"
    # Prefill engines do not read router settings: their pods stay put.
    assert before[("Deployment", "demo-prefill")] == after[("Deployment", "demo-prefill")]


def test_gateway_points_at_the_decode_sidecars():
    spec = dict(BASE, gateway={"port": 80, "replicas": 2, "serviceType": "LoadBalancer"})
    kids = children(spec)
    gw = kids[("Deployment", "demo-gateway")]
    assert gw["spec"]["replicas"] == 2
    assert container(gw, "gateway")["command"] == [
        "pdpool",
        "gateway",
        "--host",
        "0.0.0.0",
        "--port",
        "8080",
        "--metrics-port",
        "9090",
        "--decode-service",
        "demo-decode.llm.svc:8080",
    ]
    svc = kids[("Service", "demo-gateway")]["spec"]
    assert svc["type"] == "LoadBalancer" and svc["ports"][0]["port"] == 80


def test_scheduling_and_extra_args_reach_the_right_role():
    spec = dict(
        BASE,
        decode={
            "replicas": 3,
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
            "extraArgs": ["--max-num-seqs", "64"],
            "env": [{"name": "X", "value": "1"}],
            "resources": {"requests": {"cpu": "4"}},
        },
    )
    kids = children(spec)
    decode = kids[("Deployment", "demo-decode")]
    pod = decode["spec"]["template"]["spec"]
    assert decode["spec"]["replicas"] == 3
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    engine = container(decode, "engine")
    assert engine["command"][-2:] == ["--max-num-seqs", "64"]
    assert env_map(engine)["X"]["value"] == "1"
    assert engine["resources"] == {"requests": {"cpu": "4"}}
    prefill = kids[("Deployment", "demo-prefill")]
    assert "nodeSelector" not in prefill["spec"]["template"]["spec"]
    assert "--max-num-seqs" not in container(prefill, "engine")["command"]


@pytest.mark.parametrize("kind", ["pdpool", "vllm"])
def test_builders_are_deterministic(kind):
    spec = dict(BASE, engine={"image": "e", "kind": kind})
    assert build_children(REF, parse_pool_spec("demo", spec)) == build_children(
        REF, parse_pool_spec("demo", spec)
    )


# --- the pool's KV-signing Secret ----------------------------------------------------------


def pod_of(kids, role):
    return kids[("Deployment", f"demo-{role}")]["spec"]["template"]["spec"]


def kv_volumes(pod):
    return [v for v in pod.get("volumes", []) if "secret" in v]


def test_pdpool_engines_mount_the_pool_secret_read_only_and_pass_the_flag():
    kids = children()
    for role in ("prefill", "decode"):
        pod = pod_of(kids, role)
        assert kv_volumes(pod) == [
            {
                "name": "kv-secret",
                "secret": {
                    "secretName": "demo-kv-secret",
                    "defaultMode": 0o444,
                    "items": [{"key": "kv-secret", "path": "kv-secret"}],
                },
            }
        ]
        engine = container({"spec": {"template": {"spec": pod}}}, "engine")
        assert {
            "name": "kv-secret",
            "mountPath": "/etc/pdpool/kv-secret",
            "readOnly": True,
        } in engine["volumeMounts"]
        argv = engine["command"]
        assert argv[argv.index("--kv-secret-file") + 1] == "/etc/pdpool/kv-secret/kv-secret"
    # Only the engines hold the key: not the sidecar, not the gateway.
    sidecar = container(kids[("Deployment", "demo-decode")], "sidecar")
    assert not any(m["name"] == "kv-secret" for m in sidecar["volumeMounts"])
    assert "--kv-secret-file" not in sidecar["command"]
    assert not kv_volumes(pod_of(kids, "gateway"))
    # The Secret itself is not re-applied with the children (a random value would rotate).
    assert not any(m["kind"] == "Secret" for m in kids.values())


def test_kv_secret_manifest_is_owned_and_carries_the_given_value():
    pool = parse_pool_spec("demo", BASE)
    secret = kv_secret(REF, pool, "ab" * 32)
    assert secret["metadata"]["name"] == "demo-kv-secret"
    assert secret["metadata"]["namespace"] == "llm"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-123"
    assert secret["metadata"]["labels"]["pdpool.io/pool"] == "demo"
    assert secret["type"] == "Opaque" and secret["stringData"] == {"kv-secret": "ab" * 32}


def test_vllm_engines_get_no_kv_secret():
    spec = dict(
        BASE, engine={"image": "vllm:1", "kind": "vllm", "kvSecretRef": {"name": "ignored"}}
    )
    kids = children(spec)
    for role in ("prefill", "decode"):
        pod = pod_of(kids, role)
        assert not kv_volumes(pod)
        engine = container({"spec": {"template": {"spec": pod}}}, "engine")
        assert "--kv-secret-file" not in engine["command"]
        assert all(m["name"] != "kv-secret" for m in engine["volumeMounts"])
        assert not {"PDPOOL_KV_SECRET", "PDPOOL_KV_SECRET_FILE"} & set(env_map(engine))
    assert kv_secret(REF, parse_pool_spec("demo", spec), "x" * 64) is None


def test_user_secret_ref_is_mounted_and_no_secret_is_created():
    spec = dict(BASE, engine={"image": "e", "kvSecretRef": {"name": "team-kv", "key": "hmac"}})
    kids = children(spec)
    for role in ("prefill", "decode"):
        assert kv_volumes(pod_of(kids, role)) == [
            {
                "name": "kv-secret",
                "secret": {
                    "secretName": "team-kv",
                    "defaultMode": 0o444,
                    "items": [{"key": "hmac", "path": "kv-secret"}],
                },
            }
        ]
        argv = container(kids[("Deployment", f"demo-{role}")], "engine")["command"]
        assert argv[argv.index("--kv-secret-file") + 1] == "/etc/pdpool/kv-secret/kv-secret"
    assert kv_secret(REF, parse_pool_spec("demo", spec), "x" * 64) is None
    default_key = parse_pool_spec(
        "demo", dict(BASE, engine={"image": "e", "kvSecretRef": {"name": "team-kv"}})
    )
    assert default_key.engine.kv_secret_ref.key == "kv-secret"


def test_each_pool_gets_its_own_secret():
    other = PoolRef(name="other", namespace="llm", uid="uid-456")
    kids = children(ref=other)
    assert (
        kv_volumes(kids[("Deployment", "other-prefill")]["spec"]["template"]["spec"])[0]["secret"][
            "secretName"
        ]
        == "other-kv-secret"
    )
