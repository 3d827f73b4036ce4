"""The operator against a real kube-apiserver (+ etcd, + garbage collector).

No kubelet runs here: a test stands in for it by patching Deployment status
(`Pools.mark_ready`), which is exactly what the operator reads.
"""

import base64
import signal

import pytest
from kubernetes import client

from devtools.operator_kube import (
    CHILD_DEPLOYMENTS,
    OperatorProcess,
    children_exist,
    pool_manifest,
    wait_for,
)
from pdpool.operator.kube import request

# The first test to use the cluster may have to build it (cold: ~20 min on 2 cores).
pytestmark = pytest.mark.timeout(3000)


def observed(pools, name, generation):
    return (pools.get(name).get("status") or {}).get("observedGeneration") == generation


def engine_argv(deployment):
    return next(c for c in deployment.spec.template.spec.containers if c.name == "engine").command


def test_apply_creates_owned_children_with_the_right_specs(operator_process, pools):
    created = pools.create(pool_manifest("alpha", decode={"replicas": 2}))
    wait_for(lambda: children_exist(pools, "alpha"), 30, what="children of alpha")
    uid = created["metadata"]["uid"]
    deployments = pools.deployments("alpha")
    every_child = (
        list(deployments.values())
        + list(pools.services("alpha").values())
        + list(pools.config_maps("alpha").values())
    )
    for child in every_child:
        (owner,) = child.metadata.owner_references
        assert (owner.kind, owner.name, owner.uid, owner.controller) == (
            "PDInferencePool",
            "alpha",
            uid,
            True,
        )
    assert deployments["decode"].spec.replicas == 2
    assert deployments["prefill"].spec.replicas == 1
    argv = engine_argv(deployments["prefill"])
    assert argv[:3] == ["pdpool", "serve", "/models/qwen3"]
    assert argv[argv.index("--kv-host") + 1] == "$(POD_IP)"
    decode_containers = [c.name for c in deployments["decode"].spec.template.spec.containers]
    assert decode_containers == ["engine", "sidecar"]
    assert pools.services("alpha")["alpha-prefill"].spec.cluster_ip == "None"
    # The API server applied CRD defaults before the operator read the spec.
    assert pools.get("alpha")["spec"]["router"]["cacheHitThreshold"] == 0.5
    wait_for(lambda: observed(pools, "alpha", 1), 15, what="observedGeneration 1")
    status = pools.get("alpha")["status"]
    assert status["phase"] in ("Pending", "Progressing")
    assert status["gateway"]["endpoint"] == f"http://alpha-gateway.{pools.namespace}.svc:8080"
    assert {c["type"] for c in status["conditions"]} == {
        "PrefillReady",
        "DecodeReady",
        "GatewayReady",
        "RolledOut",
        "Ready",
    }


def test_children_follow_replica_and_threshold_changes(operator_process, pools):
    pools.create(pool_manifest("beta"))
    wait_for(lambda: children_exist(pools, "beta"), 30, what="children of beta")
    before = pools.deployments("beta")["decode"].spec.template.metadata.annotations
    pools.patch_spec(
        "beta",
        {
            "decode": {"replicas": 3},
            "prefill": {"replicas": 2},
            "router": {"cacheHitThreshold": 0.8},
        },
    )
    wait_for(
        lambda: pools.deployments("beta")["decode"].spec.replicas == 3,
        30,
        what="decode scaled to 3",
    )
    deployments = pools.deployments("beta")
    assert deployments["prefill"].spec.replicas == 2
    assert pools.config_maps("beta")["beta-router"].data["cacheHitThreshold"] == "0.8"
    after = deployments["decode"].spec.template.metadata.annotations
    # New router settings roll the decode pods (their sidecars read them at start).
    assert after["pdpool.io/router-config-hash"] != before["pdpool.io/router-config-hash"]
    argv = engine_argv(deployments["decode"])
    assert argv[argv.index("--global-cache-hit-threshold") + 1] == "0.8"
    wait_for(lambda: observed(pools, "beta", 2), 15, what="observedGeneration 2")


def test_status_reaches_ready_when_deployments_are_ready(operator_process, pools):
    pools.create(pool_manifest("gamma", decode={"replicas": 2}))
    wait_for(lambda: children_exist(pools, "gamma"), 30, what="children of gamma")
    pools.mark_ready("gamma", "prefill")
    pools.mark_ready("gamma", "gateway")
    pools.mark_ready("gamma", "decode", ready=1)
    wait_for(
        lambda: (pools.condition("gamma", "DecodeReady") or {}).get("reason") == "ReplicasNotReady",
        20,
        what="DecodeReady=False, 1/2",
    )
    wait_for(
        lambda: pools.condition("gamma", "PrefillReady")["status"] == "True",
        20,
        what="PrefillReady",
    )
    decode = pools.condition("gamma", "DecodeReady")
    assert decode["status"] == "False"
    assert "1/2" in decode["message"]
    assert pools.get("gamma")["status"]["phase"] == "Progressing"
    pools.mark_ready("gamma", "decode")
    wait_for(lambda: pools.get("gamma")["status"].get("phase") == "Ready", 20, what="Ready")
    status = pools.get("gamma")["status"]
    assert (status["prefillReady"], status["decodeReady"]) == ("1/1", "2/2")
    assert all(c["status"] == "True" for c in status["conditions"])
    # What `kubectl get pdip` prints: the CRD's printer columns, served as a Table.
    table = request(
        pools.custom.api_client,
        "GET",
        f"/apis/pdpool.io/v1alpha1/namespaces/{pools.namespace}/pdinferencepools",
        accept="application/json;as=Table;v=v1;g=meta.k8s.io",
    )
    columns = [c["name"] for c in table["columnDefinitions"]]
    assert columns[:5] == ["Name", "Prefill", "Decode", "Phase", "Endpoint"]
    assert columns[-1] == "Age"
    (row,) = [r["cells"] for r in table["rows"] if r["cells"][0] == "gamma"]
    assert row[1:4] == ["1/1", "2/2", "Ready"]
    # A role losing pods turns the pool back to not ready.
    pools.mark_ready("gamma", "gateway", ready=0)
    wait_for(
        lambda: pools.condition("gamma", "Ready")["status"] == "False",
        20,
        what="Ready=False after gateway loss",
    )
    assert pools.condition("gamma", "GatewayReady")["status"] == "False"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"router": {"cacheHitThreshold": 1.5}}, "spec.router.cacheHitThreshold"),
        ({"decode": {"replicas": -1}}, "spec.decode.replicas"),
        ({"model": None}, "spec.model: Required value"),
        ({"model": {"path": "/m", "huggingFaceId": "a/b"}}, "exactly one of path or huggingFaceId"),
        ({"model": {"path": "relative"}}, "a relative model.path needs model.pvc"),
        ({"prefill": {"gpus": 2, "tensorParallelSize": 4}}, "tensorParallelSize must equal gpus"),
        ({"engine": {"image": "x", "kind": "sglang"}}, "spec.engine.kind"),
        ({"prefill": {"resources": {"limits": {"cpu": "lots"}}}}, "spec.prefill.resources.limits"),
        (
            {"router": {"mode": "prefill-first"}, "prefill": {"replicas": 0}},
            "prefill-first needs at least one prefill replica",
        ),
        (
            {"router": {"kvEvents": {"enabled": True, "port": 5558}}},
            "kvEvents.port and kvEvents.replayPort must differ",
        ),
        (
            {"router": {"kvEvents": {"replayPort": 8080}}},
            "kvEvents ports cannot be 8000 (engine) or 8080 (sidecar)",
        ),
        ({"router": {"kvEvents": {"loadCostTokens": -1}}}, "spec.router.kvEvents.loadCostTokens"),
    ],
)
def test_api_server_refuses_invalid_specs_with_a_readable_message(pools, overrides, message):
    manifest = pool_manifest("bad", **overrides)
    manifest["spec"] = {k: v for k, v in manifest["spec"].items() if v is not None}
    with pytest.raises(client.ApiException) as err:
        pools.create(manifest)
    assert err.value.status == 422
    assert message in err.value.body


def test_crd_is_served_with_its_short_name_and_status_subresource(admin_api):
    resources = request(admin_api, "GET", "/apis/pdpool.io/v1alpha1")["resources"]
    names = {r["name"]: r for r in resources}
    assert names["pdinferencepools"]["shortNames"] == ["pdip"]
    assert names["pdinferencepools"]["namespaced"] is True
    assert names["pdinferencepools"]["kind"] == "PDInferencePool"
    assert "pdinferencepools/status" in names


def test_api_server_refuses_long_names(pools):
    with pytest.raises(client.ApiException) as err:
        pools.create(pool_manifest("p" * 53))
    assert "at most 52 characters" in err.value.body


def test_unhonourable_spec_gets_ready_false_and_an_event(operator_process, pools):
    # Passes the schema (tensorParallelSize alone) but no GPU was asked for.
    pools.create(pool_manifest("delta", decode={"tensorParallelSize": 2}))
    wait_for(
        lambda: (pools.condition("delta", "Ready") or {}).get("reason") == "InvalidSpec",
        30,
        what="InvalidSpec condition",
    )
    ready = pools.condition("delta", "Ready")
    assert ready["status"] == "False" and "needs gpus: 2" in ready["message"]
    assert pools.get("delta")["status"]["phase"] == "Failed"
    wait_for(
        lambda: any(
            e.reason == "InvalidSpec" and e.type == "Warning" for e in pools.events("delta")
        ),
        15,
        what="InvalidSpec event",
    )
    assert pools.deployments("delta") == {}
    # A toleration the API server refuses only when the Deployment is applied.
    pools.create(
        pool_manifest("epsilon", prefill={"tolerations": [{"key": "gpu", "operator": "Sometimes"}]})
    )
    wait_for(
        lambda: (pools.condition("epsilon", "Ready") or {}).get("reason") == "ApplyFailed",
        30,
        what="ApplyFailed condition",
    )
    assert "tolerations[0].operator" in pools.condition("epsilon", "Ready")["message"]
    assert operator_process.alive()
    # Fixing the spec recovers without a restart.
    pools.patch_spec("delta", {"decode": {"tensorParallelSize": 1}})
    wait_for(lambda: children_exist(pools, "delta"), 30, what="children after the fix")
    wait_for(
        lambda: pools.condition("delta", "Ready")["reason"] == "RolesNotReady",
        15,
        what="InvalidSpec cleared",
    )
    assert "Traceback" not in operator_process.log()


def test_restart_mid_way_converges_without_duplicates(k8s, pools, tmp_path):
    op = OperatorProcess(k8s.kubeconfig, tmp_path / "op.log").start()
    try:
        pools.create(pool_manifest("zeta", decode={"replicas": 2}))
        wait_for(lambda: "prefill" in pools.deployments("zeta"), 30, what="first child")
        op.stop(signal.SIGKILL)  # no graceful shutdown, possibly mid-reconcile
        pools.patch_spec("zeta", {"decode": {"replicas": 4}})
        pools.create(pool_manifest("eta"))  # created while no operator runs
        op.start()
        wait_for(lambda: children_exist(pools, "eta"), 30, what="eta after restart")
        wait_for(
            lambda: (
                pools.deployments("zeta").get("decode") is not None
                and pools.deployments("zeta")["decode"].spec.replicas == 4
            ),
            30,
            what="zeta decode at 4",
        )
        wait_for(lambda: observed(pools, "zeta", 2), 15, what="zeta observedGeneration 2")
        op.stop()
        op.start()  # a clean restart resumes every pool: re-applying changes nothing
        pools.patch_spec("zeta", {"decode": {"replicas": 1}})
        wait_for(
            lambda: pools.deployments("zeta")["decode"].spec.replicas == 1,
            30,
            what="zeta decode at 1 after a clean restart",
        )
        for name in ("zeta", "eta"):
            assert children_exist(pools, name)
        apps = client.AppsV1Api(pools.apps.api_client)
        names = [d.metadata.name for d in apps.list_namespaced_deployment(pools.namespace).items]
        assert sorted(names) == sorted(
            f"{p}-{r}" for p in ("zeta", "eta") for r in CHILD_DEPLOYMENTS
        )
        managers = {
            m.manager
            for m in pools.deployments("zeta")["decode"].metadata.managed_fields
            if m.operation == "Apply"
        }
        assert managers == {"pdpool-operator"}
    finally:
        op.stop()


def kv_volume(deployment):
    return next(
        (v.secret for v in deployment.spec.template.spec.volumes or [] if v.name == "kv-secret"),
        None,
    )


def test_kv_secret_is_created_once_and_never_rotated(operator_process, pools):
    created = pools.create(pool_manifest("iota"))
    wait_for(lambda: children_exist(pools, "iota"), 30, what="children of iota")
    secret = pools.secrets("iota")["iota-kv-secret"]
    (owner,) = secret.metadata.owner_references
    assert (owner.kind, owner.uid, owner.controller) == (
        "PDInferencePool",
        created["metadata"]["uid"],
        True,
    )
    value = base64.b64decode(secret.data["kv-secret"])
    assert len(value) == 64 and int(value, 16) >= 0  # 32 random bytes, hex
    deployments = pools.deployments("iota")
    for role in ("prefill", "decode"):
        volume = kv_volume(deployments[role])
        assert (volume.secret_name, volume.items[0].key) == ("iota-kv-secret", "kv-secret")
        argv = engine_argv(deployments[role])
        assert argv[argv.index("--kv-secret-file") + 1] == "/etc/pdpool/kv-secret/kv-secret"
    assert kv_volume(deployments["gateway"]) is None

    # A second reconcile (a spec change) leaves the Secret exactly as it was: not rewritten.
    pools.patch_spec("iota", {"decode": {"replicas": 2}})
    wait_for(lambda: observed(pools, "iota", 2), 30, what="iota observedGeneration 2")
    again = pools.secrets("iota")["iota-kv-secret"]
    assert again.data == secret.data
    assert again.metadata.resource_version == secret.metadata.resource_version

    # Another pool gets another secret; a pool naming its own Secret gets none created.
    pools.create(
        pool_manifest(
            "kappa", engine={"image": "pdpool-engine:test", "kvSecretRef": {"name": "shared-kv"}}
        )
    )
    pools.create(pool_manifest("lambda"))
    wait_for(
        lambda: children_exist(pools, "kappa") and children_exist(pools, "lambda"),
        30,
        what="children of kappa and lambda",
    )
    assert pools.secrets("kappa") == {}
    assert kv_volume(pools.deployments("kappa")["decode"]).secret_name == "shared-kv"
    assert pools.secrets("lambda")["lambda-kv-secret"].data != secret.data


def test_delete_removes_every_child(operator_process, pools):
    pools.create(pool_manifest("theta"))
    wait_for(lambda: children_exist(pools, "theta"), 30, what="children of theta")
    assert pools.secrets("theta")
    pools.delete("theta")
    # The garbage collector (kube-controller-manager) follows the owner references.
    wait_for(
        lambda: (
            not pools.deployments("theta")
            and not pools.services("theta")
            and not pools.config_maps("theta")
            and not pools.secrets("theta")
        ),
        60,
        interval=0.5,
        what="children deleted",
    )
    with pytest.raises(client.ApiException) as gone:
        pools.get("theta")
    assert gone.value.status == 404
