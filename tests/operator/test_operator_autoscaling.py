"""Autoscaling on a real API server.

- planner: the workloads cluster (real Deployment/ReplicaSet controllers, kwok pods); the
  operator reads every pod's metrics from an HTTP server this test runs
  (`--metrics-url-template`), which serves vLLM's metrics as a slow or an idle engine
  would; the decode Deployment's replicas follow, up and then down, with Events and the
  decision in the pool's status; leaving pods carry the drain hooks.
- hpa: the HorizontalPodAutoscalers are accepted by the API server (its own validation of
  autoscaling/v2), and the Deployments leave their replicas to them.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client

from devtools.operator_kube import OperatorProcess, Pools, api_client, pool_manifest, wait_for

pytestmark = pytest.mark.timeout(600)

BEHAVIOR = {
    "intervalSeconds": 1,
    "scaleDownStabilizationSeconds": 3,
    "upCooldownSeconds": 1,
    "downCooldownSeconds": 1,
}


class EngineMetrics:
    """What every engine pod's /metrics says: `slow` decode engines (ITL 10x the target,
    new token gaps at each scrape) or idle ones; the sidecars show nothing in flight."""

    def __init__(self):
        self.slow = False
        self.gaps = 0
        self.scrapes: dict[str, int] = {}
        self.lock = threading.Lock()

    def text(self, pod: str, port: str) -> str:
        with self.lock:
            self.scrapes[pod] = self.scrapes.get(pod, 0) + 1
            if port == "8080":
                return "# TYPE pdpool_sidecar_in_flight gauge\npdpool_sidecar_in_flight 0\n"
            slow = self.slow and "-decode-" in pod
            if slow:
                self.gaps += 50
            n = self.gaps
        return (
            "# TYPE vllm:inter_token_latency_seconds histogram\n"
            f'vllm:inter_token_latency_seconds_bucket{{le="0.05"}} 0\n'
            f'vllm:inter_token_latency_seconds_bucket{{le="1.0"}} {n}\n'
            f'vllm:inter_token_latency_seconds_bucket{{le="+Inf"}} {n}\n'
            f"vllm:inter_token_latency_seconds_count {n}\n"
            "vllm:inter_token_latency_seconds_sum 0\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running {4 if slow else 0}\n"
        )


@pytest.fixture
def metrics_server():
    metrics = EngineMetrics()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            _, pod, port, _ = self.path.split("/", 3)
            body = metrics.text(pod, port).encode()
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield metrics, server.server_address[1]
    server.shutdown()


def replicas(apps, namespace, name):
    return apps.read_namespaced_deployment(name, namespace).spec.replicas


def test_planner_scales_decode_up_on_slow_tokens_and_back_down_when_idle(
    real_k8s, metrics_server, tmp_path
):
    metrics, port = metrics_server
    api = api_client(real_k8s.server, real_k8s.ca_file, real_k8s.admin_token)
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    namespace = f"a-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": namespace}})
    template = f"http://127.0.0.1:{port}/{{pod}}/{{port}}/metrics"
    op = OperatorProcess(
        real_k8s.kubeconfig, tmp_path / "operator.log", "--metrics-url-template", template
    ).start()
    pools = Pools(api, namespace)
    try:
        pools.create(
            pool_manifest(
                "auto",
                decode={"replicas": 5},  # ignored: autoscaling owns the replicas
                autoscaling={
                    "prefill": {"min": 1, "max": 2},
                    "decode": {"min": 1, "max": 3},
                    "targets": {"ttftSeconds": 1.0, "itlSeconds": 0.05},
                    "behavior": BEHAVIOR,
                    "drainSeconds": 30,
                },
            )
        )
        wait_for(
            lambda: sum(metrics.scrapes.values()) >= 6,
            60,
            what="the planner scrapes the pods' metrics",
        )
        assert replicas(apps, namespace, "auto-decode") == 1  # min, not spec.decode.replicas

        metrics.slow = True
        wait_for(lambda: replicas(apps, namespace, "auto-decode") == 3, 60, what="decode 1 -> 3")
        status = wait_for(
            lambda: (
                (s := pools.get("auto")["status"]["autoscaling"])["decode"]["desired"] == 3 and s
            ),
            10,
            what="the decision in the status",
        )
        assert status["decode"]["desired"] == 3 and "itl" in status["decode"]["reason"]
        assert status["inputs"]["decode"]["itl_p90"] > 0.5
        assert replicas(apps, namespace, "auto-prefill") == 1  # prefill was not slow
        scaled = [e.message for e in pools.events("auto") if e.reason == "Scaled"]
        assert any(m.startswith("decode 1 -> 3: itl at") for m in scaled), scaled
        wait_for(
            lambda: (
                len(
                    core.list_namespaced_pod(
                        namespace, label_selector="pdpool.io/role=decode"
                    ).items
                )
                == 3
            ),
            60,
            what="3 decode pods",
        )

        metrics.slow = False
        t0 = time.monotonic()
        wait_for(lambda: replicas(apps, namespace, "auto-decode") == 2, 60, what="decode 3 -> 2")
        wait_for(lambda: replicas(apps, namespace, "auto-decode") == 1, 60, what="decode 2 -> 1")
        # Held through the down stabilization window (3 s) before the first step.
        assert time.monotonic() - t0 >= 3

        # The operator scales the Deployment first and records the event after it.
        def scaled_down() -> bool:
            messages = [e.message for e in pools.events("auto") if e.reason == "Scaled"]
            return all(
                any(m.startswith(step) for m in messages)
                for step in ("decode 3 -> 2", "decode 2 -> 1")
            )

        wait_for(scaled_down, 30, what="a Scaled event for each step down")

        # A leaving pod drains: held by its preStop hooks, within drainSeconds.
        deployment = apps.read_namespaced_deployment("auto-decode", namespace)
        pod = deployment.spec.template.spec
        assert pod.termination_grace_period_seconds == 30
        assert all(c.lifecycle.pre_stop._exec.command[0] == "python3" for c in pod.containers)
        # The replicas field belongs to the autoscaler's field manager, not the pool's apply.
        owners = {
            m.manager
            for m in deployment.metadata.managed_fields
            if "f:replicas" in (m.fields_v1 or {}).get("f:spec", {})
        }
        assert owners == {"pdpool-autoscaler"}, owners
    finally:
        op.stop()
        print("operator log (tail):\n" + op.log()[-3000:])
        api.close()


def test_hpa_mode_renders_hpas_the_api_server_accepts(k8s, admin_api, pools, namespace, tmp_path):
    op = OperatorProcess(k8s.kubeconfig, tmp_path / "operator.log").start()
    try:
        pools.create(
            pool_manifest(
                "hpa",
                autoscaling={
                    "mode": "hpa",
                    "prefill": {"min": 1, "max": 4},
                    "decode": {"min": 2, "max": 6},
                    "behavior": {"scaleDownStabilizationSeconds": 300},
                },
            )
        )
        hpas = client.AutoscalingV2Api(admin_api)
        wait_for(
            lambda: len(hpas.list_namespaced_horizontal_pod_autoscaler(namespace).items) == 2,
            40,
            what="two HPAs",
        )
        decode = hpas.read_namespaced_horizontal_pod_autoscaler("hpa-decode", namespace).spec
        assert (decode.min_replicas, decode.max_replicas) == (2, 6)
        assert decode.metrics[0].pods.metric.name == "vllm:kv_cache_usage_perc"
        assert decode.behavior.scale_down.stabilization_window_seconds == 300
        # The Deployment starts at the role's min; the HPA owns the replicas from then on.
        apps = client.AppsV1Api(admin_api)
        wait_for(lambda: replicas(apps, namespace, "hpa-decode") == 2, 30, what="decode at min")
        assert not pools.get("hpa").get("status", {}).get("autoscaling")  # no planner

        # Invalid: refused by the API server's schema with a clear message.
        with pytest.raises(client.ApiException) as refused:
            pools.create(
                pool_manifest(
                    "bad",
                    autoscaling={"prefill": {"min": 1, "max": 2}, "decode": {"min": 0, "max": 2}},
                )
            )
        assert refused.value.status == 422
        assert "decode.min must be" in json.loads(refused.value.body)["message"]
    finally:
        op.stop()


def test_keda_mode_renders_scaled_objects_and_a_mode_change_retires_the_other_autoscalers(
    k8s, admin_api, pools, namespace, tmp_path
):
    """KEDA's own ScaledObject CRD (pinned, from its Go module) validates what mode keda
    renders; switching modes deletes the previous mode's objects, so two autoscalers never
    own a role's replicas at once."""
    import shutil

    from devtools.gie_crds import KEDA_CRD_FILES, fetch_crds, install_crds

    if shutil.which("go") is None:
        pytest.skip("go is not installed: cannot fetch KEDA's CRD from the Go module proxy")
    install_crds(admin_api, fetch_crds(), KEDA_CRD_FILES)
    custom, hpas = client.CustomObjectsApi(admin_api), client.AutoscalingV2Api(admin_api)

    def scaled_objects():
        found = custom.list_namespaced_custom_object(
            "keda.sh", "v1alpha1", namespace, "scaledobjects"
        )
        return {o["metadata"]["name"]: o for o in found["items"]}

    def hpa_names():
        return {
            h.metadata.name for h in hpas.list_namespaced_horizontal_pod_autoscaler(namespace).items
        }

    op = OperatorProcess(k8s.kubeconfig, tmp_path / "operator.log").start()
    try:
        scaling = {
            "mode": "keda",
            "prefill": {"min": 1, "max": 2},
            "decode": {"min": 1, "max": 3},
            "keda": {"prometheusAddress": "http://prometheus.monitoring:9090"},
        }
        pools.create(pool_manifest("kd", autoscaling=scaling))
        wait_for(
            lambda: set(scaled_objects()) == {"kd-prefill", "kd-decode"}, 40, what="ScaledObjects"
        )
        decode = scaled_objects()["kd-decode"]["spec"]
        assert decode["maxReplicaCount"] == 3
        assert decode["triggers"][0]["metadata"]["threshold"] == "0.85"
        assert not hpa_names()

        pools.patch_spec("kd", {"autoscaling": {**scaling, "mode": "hpa"}})
        wait_for(
            lambda: hpa_names() == {"kd-prefill", "kd-decode"} and not scaled_objects(),
            40,
            what="keda -> hpa: HPAs in place of the ScaledObjects",
        )
        pools.patch_spec("kd", {"autoscaling": {**scaling, "mode": "planner"}})
        wait_for(lambda: not hpa_names(), 40, what="hpa -> planner: no HPA left")
        assert not scaled_objects()

        with pytest.raises(client.ApiException) as refused:
            pools.create(pool_manifest("nokeda", autoscaling={**scaling, "keda": {}}))
        assert refused.value.status == 422
        assert "needs keda.prometheusAddress" in json.loads(refused.value.body)["message"]
    finally:
        op.stop()
