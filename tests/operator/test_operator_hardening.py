"""Kubernetes hardening of a pool's children: the restricted Pod Security Standard (checked
by the API server's own PodSecurity admission), resources, PodDisruptionBudgets, spread."""

import copy

import pytest
from kubernetes import client

from pdpool.operator.builders import build_children
from pdpool.operator.children import PoolRef
from pdpool.operator.kube import collection_path, request
from pdpool.operator.spec import SpecError, parse_pool_spec

REF = PoolRef(name="demo", namespace="llm", uid="uid-123")
HF = {
    "model": {"huggingFaceId": "Qwen/Qwen3-0.6B"},
    "engine": {"image": "engine:1"},
    "router": {"image": "slim:1"},
}
VLLM = {
    "model": {"path": "/models/qwen3"},
    "engine": {"kind": "vllm", "image": "vllm:1"},
    "prefill": {"gpus": 1},
    "decode": {"gpus": 1},
}


def children(spec, ref=REF):
    return {
        (m["kind"], m["metadata"]["name"]): m
        for m in build_children(ref, parse_pool_spec(ref.name, spec))
    }


def pod_templates(kids):
    return {name: m["spec"]["template"] for (kind, name), m in kids.items() if kind == "Deployment"}


def all_containers(pod_spec):
    return pod_spec["containers"] + pod_spec.get("initContainers", [])


# --- pure ----------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [HF, VLLM], ids=["pdpool-hf", "vllm"])
def test_every_container_meets_the_restricted_profile(spec):
    for name, template in pod_templates(children(spec)).items():
        pod = template["spec"]
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 65532
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in all_containers(pod):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            # A read-only root: every container has a writable /tmp of its own.
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert "/tmp" in mounts, (name, c["name"])
            if c["name"] != "engine":  # engines: the spec's resources and GPUs
                assert c["resources"]["requests"] and c["resources"]["limits"], c["name"]


def test_engines_get_sized_shm_and_a_writable_cache_every_library_points_at():
    kids = children(HF)
    pod = pod_templates(kids)["demo-decode"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert volumes["cache"]["emptyDir"] == {} and volumes["tmp"]["emptyDir"] == {}
    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    env = {e["name"]: e.get("value") for e in engine["env"]}
    for var in (
        "HF_HOME",
        "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "XDG_CACHE_HOME",
        "VLLM_CACHE_ROOT",
    ):
        assert env[var].startswith("/cache"), var
    mounts = {m["mountPath"] for m in engine["volumeMounts"]}
    assert {"/dev/shm", "/tmp", "/cache", "/models"} <= mounts
    # The sidecar does not share the engine's /tmp.
    sidecar = next(c for c in pod["containers"] if c["name"] == "sidecar")
    assert [m["name"] for m in sidecar["volumeMounts"]] == ["sidecar-tmp"]
    init = pod["initContainers"][0]
    assert init["resources"]["limits"]["memory"] == "2Gi"
    assert {m["mountPath"] for m in init["volumeMounts"]} == {"/models", "/tmp", "/cache"}


def test_security_resources_and_shm_are_overridable():
    spec = copy.deepcopy(HF)
    spec["security"] = {
        "podSecurityContext": {"fsGroup": 65532, "runAsUser": 1000},
        "containerSecurityContext": {"readOnlyRootFilesystem": False},
        "automountServiceAccountToken": True,
        "serviceAccountName": "llm",
    }
    spec["engine"].update(shmSize="16Gi", cacheSizeLimit="50Gi")
    spec["router"]["resources"] = {"requests": {"cpu": "1"}}
    spec["gateway"] = {"resources": {"limits": {"memory": "4Gi"}}}
    spec["model"]["downloadResources"] = {"limits": {"memory": "8Gi"}}
    pods = pod_templates(children(spec))
    decode = pods["demo-decode"]["spec"]
    assert decode["securityContext"]["fsGroup"] == 65532
    assert decode["securityContext"]["runAsUser"] == 1000
    assert decode["securityContext"]["runAsNonRoot"] is True  # the rest stays
    assert decode["automountServiceAccountToken"] is True
    assert decode["serviceAccountName"] == "llm"
    sc = decode["containers"][0]["securityContext"]
    assert sc["readOnlyRootFilesystem"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    volumes = {v["name"]: v for v in decode["volumes"]}
    assert volumes["dshm"]["emptyDir"]["sizeLimit"] == "16Gi"
    assert volumes["cache"]["emptyDir"]["sizeLimit"] == "50Gi"
    sidecar = next(c for c in decode["containers"] if c["name"] == "sidecar")
    assert sidecar["resources"] == {"requests": {"cpu": "1"}}
    gateway = pods["demo-gateway"]["spec"]["containers"][0]
    assert gateway["resources"] == {"limits": {"memory": "4Gi"}}
    assert decode["initContainers"][0]["resources"] == {"limits": {"memory": "8Gi"}}


def test_a_disruption_budget_per_role_that_never_blocks_a_one_replica_drain():
    kids = children(HF)
    for role in ("prefill", "decode", "gateway"):
        pdb = kids[("PodDisruptionBudget", f"demo-{role}")]["spec"]
        assert pdb["maxUnavailable"] == 1 and "minAvailable" not in pdb
        assert pdb["selector"]["matchLabels"] == {"pdpool.io/pool": "demo", "pdpool.io/role": role}
        assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    off = children(dict(HF, disruptionBudget={"enabled": False}))
    assert off[("PodDisruptionBudget", "demo-decode")]["spec"]["maxUnavailable"] == "100%"
    pct = children(dict(HF, disruptionBudget={"maxUnavailable": "25%"}))
    assert pct[("PodDisruptionBudget", "demo-prefill")]["spec"]["maxUnavailable"] == "25%"
    with pytest.raises(SpecError, match="maxUnavailable"):
        parse_pool_spec("demo", dict(HF, disruptionBudget={"maxUnavailable": "half"}))


def test_pods_spread_over_hosts_then_zones_unless_the_spec_says_otherwise():
    pods = pod_templates(children(HF))
    for name, template in pods.items():
        spread = template["spec"]["topologySpreadConstraints"]
        assert [c["topologyKey"] for c in spread] == [
            "kubernetes.io/hostname",
            "topology.kubernetes.io/zone",
        ]
        assert all(c["whenUnsatisfiable"] == "ScheduleAnyway" for c in spread)
        role = name.rsplit("-", 1)[1]
        assert spread[0]["labelSelector"] == {
            "matchLabels": {"pdpool.io/pool": "demo", "pdpool.io/role": role}
        }
    own = [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
        }
    ]
    spread = pod_templates(children(dict(HF, decode={"topologySpreadConstraints": own})))[
        "demo-decode"
    ]["spec"]["topologySpreadConstraints"]
    assert spread == [
        {
            **own[0],
            "labelSelector": {
                "matchLabels": {"pdpool.io/pool": "demo", "pdpool.io/role": "decode"}
            },
        }
    ]


# --- the API server's PodSecurity admission --------------------------------------------------


@pytest.fixture
def restricted_namespace(admin_api, namespace):
    core = client.CoreV1Api(admin_api)
    core.patch_namespace(
        namespace,
        {
            "metadata": {
                "labels": {
                    "pod-security.kubernetes.io/enforce": "restricted",
                    "pod-security.kubernetes.io/enforce-version": "latest",
                }
            }
        },
    )
    # The ServiceAccount admission plugin wants the pod's account to exist (this cluster
    # runs no serviceaccount controller).
    try:
        core.create_namespaced_service_account(namespace, {"metadata": {"name": "default"}})
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    return namespace


def _dry_run_pod(core, namespace, name, template):
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": template["metadata"]["labels"]},
        "spec": template["spec"],
    }
    # Raw JSON (the typed client would insist GPU quantities be strings).
    return request(
        core.api_client,
        "POST",
        f"/api/v1/namespaces/{namespace}/pods",
        pod,
        "application/json",
        [("dryRun", "All")],
    )


TLS = dict(
    HF,
    tls={"secretName": "demo-pool-tls"},
    gateway={"tlsSecret": "demo-gateway-tls", "apiKeysSecret": {"name": "keys"}},
)


KV_EVENTS = dict(VLLM, router={"kvEvents": {"enabled": True}})


@pytest.mark.parametrize(
    "spec", [HF, VLLM, TLS, KV_EVENTS], ids=["pdpool-hf", "vllm", "tls-keys", "kv-events"]
)
def test_restricted_namespace_admits_every_pod_and_child(admin_api, restricted_namespace, spec):
    core = client.CoreV1Api(admin_api)
    ref = PoolRef("demo", restricted_namespace, "00000000-0000-0000-0000-000000000001")
    kids = build_children(ref, parse_pool_spec("demo", spec))
    admitted = []
    for manifest in kids:
        if manifest["kind"] == "Deployment":
            template = manifest["spec"]["template"]
            _dry_run_pod(core, restricted_namespace, manifest["metadata"]["name"], template)
            admitted.append(manifest["metadata"]["name"])
    assert sorted(admitted) == ["demo-decode", "demo-gateway", "demo-prefill"]
    # Every child (Deployments, Services, PDBs, ...) passes the API server's validation.
    for manifest in kids:
        request(
            admin_api,
            "POST",
            collection_path(manifest),
            manifest,
            "application/json",
            [("dryRun", "All")],
        )


def test_restricted_namespace_refuses_an_override_that_breaks_the_profile(
    admin_api, restricted_namespace
):
    core = client.CoreV1Api(admin_api)
    spec = dict(HF, security={"containerSecurityContext": {"allowPrivilegeEscalation": True}})
    ref = PoolRef("demo", restricted_namespace, "uid")
    template = next(
        m for m in build_children(ref, parse_pool_spec("demo", spec)) if m["kind"] == "Deployment"
    )["spec"]["template"]
    with pytest.raises(client.ApiException) as err:
        _dry_run_pod(core, restricted_namespace, "bad", template)
    body = err.value.body.decode() if isinstance(err.value.body, bytes) else err.value.body
    assert err.value.status == 403 and "allowPrivilegeEscalation" in body


# --- probes ------------------------------------------------------------------------------------


def _probes(kids, deployment, container_name):
    pod = kids[("Deployment", deployment)]["spec"]["template"]["spec"]
    c = next(c for c in pod["containers"] if c["name"] == container_name)
    return c.get("startupProbe"), c["readinessProbe"], c["livenessProbe"]


def test_engine_probes_startup_for_model_load_readiness_on_ready_liveness_on_health():
    kids = children(dict(HF, engine={"image": "engine:1", "startupTimeoutSeconds": 3600}))
    for role in ("prefill", "decode"):
        startup, ready, live = _probes(kids, f"demo-{role}", "engine")
        assert startup["httpGet"]["path"] == "/health"
        assert startup["periodSeconds"] * startup["failureThreshold"] == 3600
        assert ready["httpGet"] == {"path": "/ready", "port": "http"}
        assert live["httpGet"] == {"path": "/health", "port": "http"}
        # Generous timeouts (the 1 s default fails under load); a minute before a restart.
        assert ready["timeoutSeconds"] >= 5 and live["timeoutSeconds"] >= 10
        assert live["periodSeconds"] * live["failureThreshold"] >= 60
    # Stock vLLM has no /ready.
    _, ready, _ = _probes(children(VLLM), "demo-decode", "engine")
    assert ready["httpGet"]["path"] == "/health"


def test_sidecar_and_gateway_readiness_follow_upstreams_liveness_only_the_process():
    kids = children(HF)
    startup, ready, live = _probes(kids, "demo-decode", "sidecar")
    assert startup is None
    assert ready["httpGet"] == {"path": "/ready", "port": "router"}  # its engine's /ready
    assert live == {
        "tcpSocket": {"port": "router"},
        "periodSeconds": 10,
        "timeoutSeconds": 5,
        "failureThreshold": 6,
    }
    _, ready, live = _probes(kids, "demo-gateway", "gateway")
    assert ready["httpGet"] == {"path": "/ready", "port": "http"}  # any sidecar ready
    assert "tcpSocket" in live and "httpGet" not in live


# --- gateway API keys ------------------------------------------------------------------------


def test_gateway_api_keys_come_from_a_secret_mounted_in_the_gateway_only():
    kids = children(dict(HF, gateway={"apiKeysSecret": {"name": "llm-keys"}}))
    pod = pod_templates(kids)["demo-gateway"]["spec"]
    gateway = pod["containers"][0]
    argv = gateway["command"]
    assert argv[argv.index("--api-keys-file") + 1] == "/etc/pdpool/api-keys/api-keys"
    assert {"name": "api-keys", "mountPath": "/etc/pdpool/api-keys", "readOnly": True} in gateway[
        "volumeMounts"
    ]
    assert {
        "name": "api-keys",
        "secret": {
            "secretName": "llm-keys",
            "defaultMode": 0o444,
            "items": [{"key": "api-keys", "path": "api-keys"}],
        },
    } in pod["volumes"]
    for role in ("prefill", "decode"):
        assert not any(
            v["name"] == "api-keys" for v in pod_templates(kids)[f"demo-{role}"]["spec"]["volumes"]
        )
    open_gateway = pod_templates(children(HF))["demo-gateway"]["spec"]["containers"][0]
    assert "--api-keys-file" not in open_gateway["command"]


def test_gateway_serves_tls_from_a_secret_and_probes_follow():
    kids = children(dict(HF, gateway={"tlsSecret": "demo-gateway-tls"}))
    pod = pod_templates(kids)["demo-gateway"]["spec"]
    gateway = pod["containers"][0]
    argv = gateway["command"]
    assert argv[argv.index("--tls-cert-file") + 1] == "/etc/pdpool/tls/tls.crt"
    assert argv[argv.index("--tls-key-file") + 1] == "/etc/pdpool/tls/tls.key"
    assert gateway["ports"][0]["name"] == "https"
    assert gateway["readinessProbe"]["httpGet"] == {
        "path": "/ready",
        "port": "https",
        "scheme": "HTTPS",
    }
    assert gateway["livenessProbe"]["tcpSocket"] == {"port": "https"}
    assert {
        "name": "tls",
        "secret": {"secretName": "demo-gateway-tls", "defaultMode": 0o444},
    } in pod["volumes"]


@pytest.mark.parametrize("kind", ["pdpool", "vllm"])
def test_pool_tls_serves_https_on_every_hop_and_verifies_with_the_pools_ca(kind):
    spec = dict(HF, tls={"secretName": "demo-pool-tls"}, engine={"image": "e:1", "kind": kind})
    pods = pod_templates(children(spec))
    tls_volume = {
        "name": "pool-tls",
        "secret": {"secretName": "demo-pool-tls", "defaultMode": 0o444},
    }
    mount = {"name": "pool-tls", "mountPath": "/etc/pdpool/pool-tls", "readOnly": True}
    for role in ("prefill", "decode"):
        pod = pods[f"demo-{role}"]["spec"]
        assert tls_volume in pod["volumes"]
        engine = pod["containers"][0]
        argv = engine["command"]
        cert_flag = "--ssl-certfile" if kind == "vllm" else "--tls-cert-file"
        assert argv[argv.index(cert_flag) + 1] == "/etc/pdpool/pool-tls/tls.crt"
        assert mount in engine["volumeMounts"]
        # Every HTTP port says https, the metrics port too (stock vLLM: its one API port).
        http_ports = [(p["name"], p["containerPort"]) for p in engine["ports"][:-1]]
        assert http_ports == (
            [("metrics-tls", 8000)] if kind == "vllm" else [("https", 8000), ("metrics-tls", 9090)]
        )
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert engine[probe]["httpGet"]["scheme"] == "HTTPS"
    sidecar = pods["demo-decode"]["spec"]["containers"][1]
    argv = sidecar["command"]
    assert argv[argv.index("--decode-url") + 1] == "https://127.0.0.1:8000"
    assert argv[argv.index("--tls-ca-file") + 1] == "/etc/pdpool/pool-tls/ca.crt"
    assert "--tls-any-name" in argv and "--tls-cert-file" in argv
    assert sidecar["readinessProbe"]["httpGet"] == {
        "path": "/ready",
        "port": "router-tls",
        "scheme": "HTTPS",
    }
    assert [p["name"] for p in sidecar["ports"]] == ["router-tls", "sc-metrics-tls"]
    gateway = pods["demo-gateway"]["spec"]["containers"][0]
    assert "--tls-ca-file" in gateway["command"] and "--tls-any-name" in gateway["command"]
    assert "--tls-cert-file" not in gateway["command"]  # clients: gateway.tlsSecret decides
    assert mount in gateway["volumeMounts"]
    # Without spec.tls nothing changes.
    plain = pod_templates(children(HF))["demo-decode"]["spec"]["containers"]
    assert "--tls-ca-file" not in plain[1]["command"] and plain[0]["ports"][0]["name"] == "http"
