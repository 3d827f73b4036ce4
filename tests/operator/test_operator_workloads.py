"""A pool reaches Ready through the real controllers, with no status patching.

A second throwaway cluster with workloads: the deployment, replicaset, serviceaccount and
disruption controllers, kube-scheduler, and kwok playing the kubelet of two fake GPU
nodes (pods go Running and Ready at once, no containers run). The chart is installed with
Helm into a namespace that enforces the restricted Pod Security Standard, the operator
runs with the chart's ServiceAccount, and the chart's example pool is created: every pod
must be admitted, scheduled and ready, and the pool Ready; then scaled and deleted.
"""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest
import yaml
from kubernetes import client

from devtools.operator_kube import CHART, OperatorProcess, Pools, api_client, wait_for

pytestmark = pytest.mark.timeout(3000)
RELEASE = "pdw"


def helm(k8s, *args):
    proc = subprocess.run(
        [str(k8s.bin_dir / "helm"), *args, "--kubeconfig", str(k8s.kubeconfig)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def pods_of(core, namespace, selector):
    return core.list_namespaced_pod(namespace, label_selector=selector).items


def test_example_pool_reaches_ready_through_the_real_controllers(real_k8s, tmp_path):
    api = api_client(real_k8s.server, real_k8s.ca_file, real_k8s.admin_token)
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    namespace = f"w-{uuid.uuid4().hex[:6]}"
    core.create_namespace(
        {
            "metadata": {
                "name": namespace,
                "labels": {
                    "pod-security.kubernetes.io/enforce": "restricted",
                    "pod-security.kubernetes.io/enforce-version": "latest",
                },
            }
        }
    )

    t0 = time.monotonic()
    # The chart, namespaced (the default): the operator's own pod is admitted too.
    helm(
        real_k8s,
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        namespace,
        "--set",
        "aggregatedRoles=false",
    )
    wait_for(
        lambda: (
            apps.read_namespaced_deployment(
                f"{RELEASE}-pdpool-operator", namespace
            ).status.ready_replicas
            == 1
        ),
        60,
        what="operator Deployment ready",
    )
    token = core.create_namespaced_service_account_token(
        f"{RELEASE}-pdpool-operator",
        namespace,
        {"spec": {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": 3600}},
    ).status.token
    print(f"\nhelm install -> operator pod ready: {time.monotonic() - t0:.1f} s")
    kubeconfig = real_k8s.write_kubeconfig(tmp_path / "sa.kubeconfig", token, "operator")
    op = OperatorProcess(kubeconfig, tmp_path / "operator.log", "--namespace", namespace).start()
    pools = Pools(api, namespace)
    try:
        # `kubectl apply` of the chart's example pool (GPU pods: the fake nodes have GPUs).
        rendered = helm(
            real_k8s,
            "template",
            RELEASE,
            str(CHART),
            "--namespace",
            namespace,
            "--set",
            "examplePool.enabled=true",
            "--show-only",
            "templates/example-pool.yaml",
        )
        manifest = yaml.safe_load(rendered)
        name = manifest["metadata"]["name"]
        time.sleep(1)  # the operator's watch is up (it lists pools at start anyway)
        start = time.monotonic()
        pools.create(manifest)
        wait_for(
            lambda: pools.get(name).get("status", {}).get("phase") == "Ready",
            120,
            interval=0.1,
            what="pool Ready through the real controllers",
        )
        apply_to_ready = time.monotonic() - start
        print(f"\napply -> Ready (3 Deployments, 3 pods, real controllers): {apply_to_ready:.2f} s")

        status = pools.get(name)["status"]
        assert (status["prefillReady"], status["decodeReady"], status["gatewayReady"]) == (
            "1/1",
            "1/1",
            "1/1",
        )
        pods = pods_of(core, namespace, f"pdpool.io/pool={name}")
        assert sorted(p.metadata.labels["pdpool.io/role"] for p in pods) == [
            "decode",
            "gateway",
            "prefill",
        ]
        for pod in pods:  # admitted under `restricted`, scheduled, running, ready
            assert pod.status.phase == "Running" and pod.spec.node_name.startswith("kwok-")
            assert pod.spec.automount_service_account_token is False
            assert pod.spec.security_context.run_as_non_root is True
        no_failed = [
            e for e in core.list_namespaced_event(namespace).items if e.reason == "FailedCreate"
        ]
        assert not no_failed, [e.message for e in no_failed]
        pdb = client.PolicyV1Api(api).read_namespaced_pod_disruption_budget(
            f"{name}-decode", namespace
        )
        wait_for(
            lambda: (
                client.PolicyV1Api(api)
                .read_namespaced_pod_disruption_budget(f"{name}-decode", namespace)
                .status.current_healthy
                == 1
            ),
            30,
            what="PDB status",
        )
        assert pdb.spec.max_unavailable == 1

        # Scale: the Deployment controller makes the pods, the pool follows.
        t0 = time.monotonic()
        pools.patch_spec(name, {"decode": {"replicas": 2}})
        wait_for(
            lambda: pools.get(name).get("status", {}).get("decodeReady") == "2/2",
            60,
            what="decode 2/2",
        )
        wait_for(
            lambda: pools.get(name)["status"].get("phase") == "Ready",
            30,
            what="Ready after scaling",
        )
        print(f"scale decode 1 -> 2 -> Ready: {time.monotonic() - t0:.2f} s")
        decode_pods = pods_of(core, namespace, f"pdpool.io/pool={name},pdpool.io/role=decode")
        assert len(decode_pods) == 2
        # The topology spread put them on different (fake) nodes.
        assert len({p.spec.node_name for p in decode_pods}) == 2

        # Delete: the garbage collector removes Deployments, ReplicaSets and pods.
        t0 = time.monotonic()
        pools.delete(name)
        wait_for(
            lambda: (
                not apps.list_namespaced_deployment(
                    namespace, label_selector=f"pdpool.io/pool={name}"
                ).items
            ),
            60,
            what="Deployments gone",
        )
        wait_for(
            lambda: not pods_of(core, namespace, f"pdpool.io/pool={name}"), 60, what="pods gone"
        )
        print(f"delete -> every pod gone: {time.monotonic() - t0:.2f} s")
        log = op.log()
        assert "403" not in log and "Forbidden" not in log, log[-3000:]
    finally:
        op.stop()
        print("operator log (tail):\n" + op.log()[-2000:])
        api.close()
