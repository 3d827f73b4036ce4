"""spec.inferencePool: the pool as a Gateway API Inference Extension InferencePool with
`pdpool epp` as its endpoint picker. Pure builders first, then the real API server with
GIE's published CRDs (pinned, fetched by scripts/gie/fetch-crds.sh)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import yaml
from kubernetes import client

from devtools.operator_kube import OperatorProcess, pool_manifest, wait_for
from pdpool.cli import build_parser
from pdpool.operator.builders import build_children
from pdpool.operator.children import PoolRef
from pdpool.operator.inference_pool import inference_pool_parents
from pdpool.operator.kube import collection_path, request
from pdpool.operator.spec import SpecError, parse_pool_spec

REF = PoolRef(name="demo", namespace="llm", uid="uid-123")
BASE = {
    "model": {"path": "/models/qwen3"},
    "engine": {"image": "engine:1"},
    "router": {"image": "slim:1"},
}
GIE = dict(
    BASE,
    inferencePool={
        "enabled": True,
        "failureMode": "FailOpen",
        "parentRefs": [{"name": "inference-gateway", "namespace": "gateways"}],
    },
)


def kids(spec, ref=REF):
    return {
        (m["kind"], m["metadata"]["name"]): m
        for m in build_children(ref, parse_pool_spec(ref.name, spec))
    }


# --- pure ----------------------------------------------------------------------------------


def test_off_by_default_renders_nothing_of_gie():
    assert not [k for k in kids(BASE) if k[1] == "demo-epp" or k[0] == "InferencePool"]
    off = dict(BASE, inferencePool={"enabled": False, "failureMode": "FailOpen"})
    assert kids(off).keys() == kids(BASE).keys()


def test_the_inference_pool_selects_the_decode_sidecars_and_names_the_epp():
    objects = kids(GIE)
    pool = objects[("InferencePool", "demo")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    decode = objects[("Deployment", "demo-decode")]
    labels = decode["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    sidecar = next(
        c for c in decode["spec"]["template"]["spec"]["containers"] if c["name"] == "sidecar"
    )
    assert pool["spec"]["targetPorts"] == [{"number": sidecar["ports"][0]["containerPort"]}]
    picker = pool["spec"]["endpointPickerRef"]
    service = objects[("Service", "demo-epp")]
    assert picker["kind"] == "Service" and picker["name"] == "demo-epp"
    assert picker["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    assert picker["failureMode"] == "FailOpen"
    # The EPP Service reaches the EPP pods.
    epp = objects[("Deployment", "demo-epp")]
    assert (
        service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    )
    # Every GIE object is owned by the pool (garbage-collected with it).
    for kind in ("InferencePool", "HTTPRoute"):
        (owner,) = objects[(kind, "demo")]["metadata"]["ownerReferences"]
        assert owner["kind"] == "PDInferencePool" and owner["controller"] is True


def test_the_epp_runs_pdpool_epp_over_the_decode_service_with_no_api_token():
    objects = kids(dict(GIE, router={"image": "slim:1", "kvEvents": {"enabled": True}}))
    pod = objects[("Deployment", "demo-epp")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    argv = container["command"]
    assert argv[:2] == ["pdpool", "epp"]
    assert argv[argv.index("--decode-service") + 1] == "demo-decode.llm.svc:8080"
    assert "--kv-events-port" in argv  # the same precise routing as the gateway
    assert container["image"] == "slim:1"
    assert pod["automountServiceAccountToken"] is False
    assert objects[("ServiceAccount", "demo-epp")]["automountServiceAccountToken"] is False
    assert container["readinessProbe"]["grpc"]["port"] in [
        p["containerPort"] for p in container["ports"]
    ]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    # The real CLI takes the rendered command, with the ports the objects name.
    args = build_parser().parse_args(argv[1:])
    assert args._module is not None and args.decode_service == "demo-decode.llm.svc:8080"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (args.port, args.health_port, args.metrics_port) == (
        ports["grpc"],
        ports["grpc-health"],
        ports["metrics"],
    )
    assert args.kv_events_port is not None


def test_the_http_route_sends_its_gateways_traffic_to_the_inference_pool():
    route = kids(GIE)[("HTTPRoute", "demo")]
    assert route["spec"]["parentRefs"] == [{"name": "inference-gateway", "namespace": "gateways"}]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "demo"}
    ]
    no_parents = dict(GIE, inferencePool={"enabled": True})
    assert ("HTTPRoute", "demo") not in kids(no_parents)
    assert (
        kids(no_parents)[("InferencePool", "demo")]["spec"]["endpointPickerRef"]["failureMode"]
        == "FailClose"
    )


def test_network_policies_open_the_epp_and_the_sidecars_to_the_named_data_plane_only():
    envoy = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "envoy"}}}
    named = dict(GIE, inferencePool={**GIE["inferencePool"], "gatewayFrom": [envoy]})
    for spec, data_plane in ((GIE, []), (named, [envoy])):
        objects = kids(spec)
        epp_rules = objects[("NetworkPolicy", "demo-epp")]["spec"]["ingress"]
        ext_proc = [r for r in epp_rules if {"protocol": "TCP", "port": 9002} in r["ports"]]
        assert [r["from"] for r in ext_proc] == ([data_plane] if data_plane else [])
        decode_rules = objects[("NetworkPolicy", "demo-decode-sidecar")]["spec"]["ingress"]
        # Every rule names its sources: none is open to the whole cluster.
        assert all(rule.get("from") for rule in decode_rules)
        sidecar = next(r for r in decode_rules if {"protocol": "TCP", "port": 8080} in r["ports"])
        epp_pods = {
            "podSelector": {"matchLabels": {"pdpool.io/pool": "demo", "pdpool.io/role": "epp"}}
        }
        assert epp_pods in sidecar["from"]
        assert all(p in sidecar["from"] for p in data_plane)
        assert {"namespaceSelector": {}} not in sidecar["from"]
    # Children are in a safe order: the EPP's policy before its Deployment.
    order = [
        (m["kind"], m["metadata"]["name"])
        for m in build_children(REF, parse_pool_spec("demo", GIE))
    ]
    assert order.index(("NetworkPolicy", "demo-epp")) < order.index(("Deployment", "demo-epp"))


@pytest.mark.parametrize(
    "section, message",
    [
        ({"enabled": "yes"}, "enabled must be true or false"),
        ({"enabled": True, "failureMode": "Sometimes"}, "failureMode must be one of"),
        ({"enabled": True, "parentRefs": [{"namespace": "x"}]}, r"parentRefs\[0\] needs a name"),
        ({"enabled": True, "parentRefs": [{"name": "g", "color": 1}]}, "unknown fields: color"),
        ({"enabled": True, "epp": {"replicas": 0}}, "epp.replicas must be an integer >= 1"),
    ],
)
def test_bad_sections_are_refused_with_the_field_named(section, message):
    with pytest.raises(SpecError, match=message):
        parse_pool_spec("demo", dict(BASE, inferencePool=section))


def test_parents_conditions_are_read_from_the_inference_pool_status():
    live = {
        "status": {
            "parents": [
                {
                    "parentRef": {"name": "gw", "kind": "Gateway"},
                    "controllerName": "example.com/gateway",
                    "conditions": [
                        {
                            "type": "Accepted",
                            "status": "True",
                            "reason": "Accepted",
                            "message": "",
                            "lastTransitionTime": "2026-01-01T00:00:00Z",
                        },
                    ],
                }
            ]
        }
    }
    assert inference_pool_parents(live) == [
        {
            "parentRef": {"name": "gw", "kind": "Gateway"},
            "conditions": [
                {"type": "Accepted", "status": "True", "reason": "Accepted", "message": ""}
            ],
        }
    ]
    assert inference_pool_parents(None) == [] and inference_pool_parents({}) == []


def test_operator_render_shows_the_gie_objects(tmp_path):
    path = tmp_path / "pool.yaml"
    path.write_text(
        yaml.safe_dump(
            pool_manifest("demo", **{k: v for k, v in GIE.items() if k == "inferencePool"})
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "pdpool.cli", "operator", "render", "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(done.stdout) if d}
    assert {"InferencePool", "HTTPRoute", "ServiceAccount"} <= kinds


# --- the real API server with GIE's CRDs ------------------------------------------------------


@pytest.fixture(scope="module")
def gie_crds(k8s):
    from devtools.gie_crds import fetch_crds, install_crds
    from devtools.operator_kube import api_client

    if shutil.which("go") is None:
        pytest.skip("go is not installed: cannot fetch the GIE CRDs from the Go module proxy")
    folder = fetch_crds()  # a failure fails the tests (the proxy serves the pinned versions)
    api = api_client(k8s.server, k8s.ca_file, k8s.admin_token)
    install_crds(api, folder)
    api.close()
    return folder


@pytest.fixture
def restricted(admin_api, namespace):
    core = client.CoreV1Api(admin_api)
    core.patch_namespace(
        namespace,
        {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}},
    )
    try:
        core.create_namespaced_service_account(namespace, {"metadata": {"name": "default"}})
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    return namespace


def test_the_api_server_accepts_every_gie_child_and_admits_the_epp_as_restricted(
    gie_crds, admin_api, restricted
):
    ref = PoolRef("demo", restricted, "00000000-0000-0000-0000-000000000001")
    children = build_children(ref, parse_pool_spec("demo", GIE))
    core = client.CoreV1Api(admin_api)
    # The EPP's ServiceAccount first: the ServiceAccount admission plugin wants it to exist.
    # (without its owner reference: no such pool exists, the garbage collector would take it)
    account = next(m for m in children if m["kind"] == "ServiceAccount")
    unowned = {
        **account,
        "metadata": {k: v for k, v in account["metadata"].items() if k != "ownerReferences"},
    }
    request(admin_api, "POST", collection_path(account), unowned, "application/json")
    epp = next(
        m for m in children if m["kind"] == "Deployment" and m["metadata"]["name"] == "demo-epp"
    )
    template = epp["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "demo-epp", "labels": template["metadata"]["labels"]},
        "spec": template["spec"],
    }
    request(
        core.api_client,
        "POST",
        f"/api/v1/namespaces/{restricted}/pods",
        pod,
        "application/json",
        [("dryRun", "All")],
    )
    for manifest in children:
        if manifest is account:
            continue
        request(
            admin_api,
            "POST",
            collection_path(manifest),
            manifest,
            "application/json",
            [("dryRun", "All")],
        )
    # The InferencePool's own schema refuses what GIE forbids (a bad failureMode).
    bad = next(m for m in children if m["kind"] == "InferencePool")
    bad = {
        **bad,
        "spec": {
            **bad["spec"],
            "endpointPickerRef": {**bad["spec"]["endpointPickerRef"], "failureMode": "Maybe"},
        },
    }
    with pytest.raises(client.ApiException) as refused:
        request(
            admin_api, "POST", collection_path(bad), bad, "application/json", [("dryRun", "All")]
        )
    assert refused.value.status == 422


@pytest.fixture(scope="module")
def gie_operator(k8s, gie_crds, tmp_path_factory):
    """An operator started after GIE's CRDs exist (it watches InferencePools)."""
    op = OperatorProcess(k8s.kubeconfig, tmp_path_factory.mktemp("operator-gie") / "operator.log")
    op.start()
    yield op
    op.stop()
    print("operator log (tail):\n" + op.log()[-4000:])


def test_the_operator_applies_the_inference_pool_and_shows_its_parents(
    gie_operator, pools, admin_api
):
    pools.create(pool_manifest("gie", inferencePool={"enabled": True}))
    custom = client.CustomObjectsApi(admin_api)
    args = ("inference.networking.k8s.io", "v1", pools.namespace, "inferencepools", "gie")

    def inference_pool():
        try:
            return custom.get_namespaced_custom_object(*args)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    live = wait_for(inference_pool, 60, what="the InferencePool")
    assert live["spec"]["endpointPickerRef"]["name"] == "gie-epp"
    assert live["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    assert "gie-epp" in pools.deployments("gie") or any(
        d.metadata.name == "gie-epp"
        for d in client.AppsV1Api(admin_api).list_namespaced_deployment(pools.namespace).items
    )
    # A Gateway controller accepts the pool: the pool's status shows it.
    parent = {
        "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw"},
        "controllerName": "example.com/gateway-controller",
        "conditions": [
            {
                "type": "Accepted",
                "status": "True",
                "reason": "Accepted",
                "message": "ok",
                "lastTransitionTime": "2026-11-25T00:00:00Z",
                "observedGeneration": 1,
            },
        ],
    }
    custom.patch_namespaced_custom_object_status(*args, {"status": {"parents": [parent]}})

    def shown():
        status = (pools.get("gie").get("status") or {}).get("inferencePool") or {}
        return status if status.get("parents") else None

    status = wait_for(shown, 60, what="the InferencePool's parents in the pool's status")
    assert status["name"] == "gie"
    assert status["parents"][0]["parentRef"]["name"] == "gw"
    assert status["parents"][0]["conditions"][0]["type"] == "Accepted"


# --- adapters: GIE's InferenceModelRewrite for weighted rollouts ------------------------------

ROLLOUT = {
    "adapters": [
        {
            "name": "sql",
            "hub": "acme/sql-v2",
            "rollout": [{"adapter": "sql", "weight": 90}, {"adapter": "sql-v3", "weight": 10}],
        },
        {"name": "sql-v3", "hub": "acme/sql-v3"},
        {"name": "chat", "path": "/models/chat", "rollout": [{"adapter": "chat-v2", "weight": 1}]},
        {"name": "chat-v2", "path": "/models/chat-v2"},
        {"name": "legal", "path": "/models/legal"},
    ]
}


def test_rollouts_become_one_inference_model_rewrite_of_the_pool():
    objects = kids(dict(GIE, loras=ROLLOUT))
    rewrite = objects[("InferenceModelRewrite", "demo-adapters")]
    assert rewrite["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
    assert rewrite["spec"]["poolRef"] == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": "demo",
    }
    assert rewrite["spec"]["rules"] == [
        {
            "matches": [{"model": {"type": "Exact", "value": "sql"}}],
            "targets": [
                {"modelRewrite": "sql", "weight": 90},
                {"modelRewrite": "sql-v3", "weight": 10},
            ],
        },
        {
            "matches": [{"model": {"type": "Exact", "value": "chat"}}],
            "targets": [{"modelRewrite": "chat-v2", "weight": 1}],
        },
    ]
    (owner,) = rewrite["metadata"]["ownerReferences"]
    assert owner["kind"] == "PDInferencePool" and owner["controller"] is True
    # Every target is an adapter both roles' engines serve.
    for name in ("demo-prefill", "demo-decode"):
        argv = next(
            c
            for c in objects[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
            if c["name"] == "engine"
        )["command"]
        served = {a.split("=", 2)[1] for a in argv if a.startswith("--lora-modules=")}
        for rule in rewrite["spec"]["rules"]:
            assert {t["modelRewrite"] for t in rule["targets"]} <= served


def test_no_rewrite_without_a_rollout_or_without_the_inference_pool():
    plain = {"adapters": [{"name": "legal", "path": "/models/legal"}]}
    assert not [k for k in kids(dict(GIE, loras=plain)) if k[0] == "InferenceModelRewrite"]
    assert not [k for k in kids(dict(BASE, loras=ROLLOUT)) if k[0] == "InferenceModelRewrite"]
    # The operator deletes a rewrite the spec no longer renders (its retired children).
    from pdpool.operator.builders import retired_children

    retired = {
        (m["kind"], m["metadata"]["name"])
        for m in retired_children(REF, parse_pool_spec("demo", dict(GIE, loras=plain)))
    }
    assert ("InferenceModelRewrite", "demo-adapters") in retired
    kept = retired_children(REF, parse_pool_spec("demo", dict(GIE, loras=ROLLOUT)))
    assert ("InferenceModelRewrite", "demo-adapters") not in {
        (m["kind"], m["metadata"]["name"]) for m in kept
    }


def _container(objects, deployment: str, name: str) -> dict:
    spec = objects[("Deployment", deployment)]["spec"]["template"]["spec"]
    container = next(c for c in spec["containers"] if c["name"] == name)
    return {**container, "volumes": spec["volumes"]}


def test_the_rules_reach_our_epp_and_gateway_as_a_mounted_file():
    from pdpool.sidecar.routing.model_rewrite import parse_rewrites

    objects = kids(dict(GIE, loras=ROLLOUT))
    config = objects[("ConfigMap", "demo-model-rewrites")]
    (text,) = config["data"].values()
    rewrite = objects[("InferenceModelRewrite", "demo-adapters")]
    assert yaml.safe_load(text) == {"rules": rewrite["spec"]["rules"]}  # the same rules
    rules = parse_rewrites(text)  # as the routers read them
    assert rules.by_model["sql"].targets == ("sql", "sql-v3")
    assert rules.by_model["sql"].cumulative == (90, 100)
    order = [k for k in objects]  # the ConfigMap exists before the routers that mount it
    assert order.index(("ConfigMap", "demo-model-rewrites")) < min(
        order.index(("Deployment", d)) for d in ("demo-epp", "demo-gateway")
    )
    for deployment, name in (("demo-epp", "epp"), ("demo-gateway", "gateway")):
        c = _container(objects, deployment, name)
        args = build_parser().parse_args(c["command"][1:])  # the real CLI takes it
        path = args.model_rewrites_file
        (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        assert mount["readOnly"] is True and "subPath" not in mount  # edits reach the file
        (volume,) = [v for v in c["volumes"] if v["name"] == mount["name"]]
        assert volume["configMap"]["name"] == "demo-model-rewrites"
        assert path.rsplit("/", 1)[1] in config["data"]
    # Without the InferencePool our gateway still splits; without a rollout nothing is
    # rendered, and the operator deletes the ConfigMap an earlier spec had.
    plain_gateway = kids(dict(BASE, loras=ROLLOUT))
    assert ("ConfigMap", "demo-model-rewrites") in plain_gateway
    assert "--model-rewrites" in _container(plain_gateway, "demo-gateway", "gateway")["command"]
    plain = {"adapters": [{"name": "legal", "path": "/models/legal"}]}
    none = kids(dict(GIE, loras=plain))
    assert ("ConfigMap", "demo-model-rewrites") not in none
    for deployment, name in (("demo-epp", "epp"), ("demo-gateway", "gateway")):
        assert "--model-rewrites" not in _container(none, deployment, name)["command"]
    from pdpool.operator.builders import retired_children

    def retired(loras):
        return {
            (m["kind"], m["metadata"]["name"])
            for m in retired_children(REF, parse_pool_spec("demo", dict(GIE, loras=loras)))
        }

    assert ("ConfigMap", "demo-model-rewrites") in retired(plain)
    assert ("ConfigMap", "demo-model-rewrites") not in retired(ROLLOUT)


def test_the_api_server_accepts_the_rewrite_and_refuses_what_gie_forbids(
    gie_crds, admin_api, namespace
):
    ref = PoolRef("demo", namespace, "00000000-0000-0000-0000-000000000002")
    (rewrite,) = [
        m
        for m in build_children(ref, parse_pool_spec("demo", dict(GIE, loras=ROLLOUT)))
        if m["kind"] == "InferenceModelRewrite"
    ]
    path = collection_path(rewrite)
    group = "/apis/inference.networking.x-k8s.io/v1alpha2"
    assert path == f"{group}/namespaces/{namespace}/inferencemodelrewrites"
    request(admin_api, "POST", path, rewrite, "application/json", [("dryRun", "All")])
    # GIE's schema is really applied: a weight of 0 is refused (the spec's check is the same).
    bad = json_copy(rewrite)
    bad["spec"]["rules"][0]["targets"][0]["weight"] = 0
    with pytest.raises(client.ApiException) as refused:
        request(admin_api, "POST", path, bad, "application/json", [("dryRun", "All")])
    assert refused.value.status == 422 and "weight" in refused.value.body


def json_copy(obj):
    import json

    return json.loads(json.dumps(obj))


def test_the_operator_applies_the_rewrite_and_deletes_it_when_rollouts_end(
    gie_operator, pools, admin_api
):
    pools.create(pool_manifest("roll", inferencePool={"enabled": True}, loras=ROLLOUT))
    custom = client.CustomObjectsApi(admin_api)
    args = (
        "inference.networking.x-k8s.io",
        "v1alpha2",
        pools.namespace,
        "inferencemodelrewrites",
        "roll-adapters",
    )

    def rewrite():
        try:
            return custom.get_namespaced_custom_object(*args)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    live = wait_for(rewrite, 60, what="the InferenceModelRewrite")
    assert live["spec"]["poolRef"]["name"] == "roll"
    assert [r["matches"][0]["model"]["value"] for r in live["spec"]["rules"]] == ["sql", "chat"]
    # The rollout is over: sql-v3 serves as itself, the rewrite goes.
    done = json_copy(ROLLOUT)
    for adapter in done["adapters"]:
        adapter.pop("rollout", None)
    pools.patch_spec("roll", {"loras": done})
    wait_for(lambda: rewrite() is None, 60, what="the rewrite deleted")
