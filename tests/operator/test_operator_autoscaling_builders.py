"""`spec.autoscaling` without a cluster: the spec's refusals, what an autoscaled pool
renders (no replicas in the Deployments, drain hooks, HPAs only in hpa mode), the drain
script against real metrics text, and the planner loop against a cluster stand-in that
records the calls (the real API server is in test_operator_autoscaling.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from devtools.operator_kube import pool_manifest
from pdpool.operator.autoscaler import Autoscaler
from pdpool.operator.autoscaling import scrape_targets
from pdpool.operator.drain import DRAIN_SCRIPT
from pdpool.operator.builders import build_children
from pdpool.operator.children import PoolRef
from pdpool.operator.spec import SpecError, parse_pool_spec
from pdpool.planner.metrics import EndpointMetrics, Snapshot, parse_text

REF = PoolRef("qwen", "ns", "uid-1")
SCALING = {"prefill": {"min": 1, "max": 3}, "decode": {"min": 1, "max": 4}}


def spec(**autoscaling):
    return pool_manifest("qwen", autoscaling={**SCALING, **autoscaling})["spec"]


def children(**autoscaling):
    pool = parse_pool_spec("qwen", spec(**autoscaling))
    return {(m["kind"], m["metadata"]["name"]): m for m in build_children(REF, pool)}


@pytest.mark.parametrize(
    ("autoscaling", "message"),
    [
        ({"decode": {"min": 0, "max": 2}}, "decode min must be >= 1"),
        ({"prefill": {"min": 0, "max": 2}}, "scaleToZero"),
        ({"prefill": {"min": 3, "max": 2}}, "need 0 <= min <= max"),
        ({"prefill": {"min": 1}}, "prefill.max is required"),
        ({"targets": {"ttftSeconds": 0}}, "ttftSeconds must be a number >= 0.001"),
        ({"behavior": {"maxStepUp": 0}}, "maxStepUp must be an integer >= 1"),
        ({"hpa": {"decodeMetric": {"averageValue": "lots"}}}, "not a quantity"),
        ({"drainSeconds": 1}, "drainSeconds must be an integer >= 10"),
    ],
)
def test_autoscaling_spec_refusals_name_the_field(autoscaling, message):
    with pytest.raises(SpecError, match=message):
        parse_pool_spec("qwen", spec(**autoscaling))


def test_planner_mode_leaves_replicas_to_the_planner_and_drains_leaving_pods():
    out = children(drainSeconds=120)
    for role in ("prefill", "decode"):
        d = out[("Deployment", f"qwen-{role}")]
        assert "replicas" not in d["spec"]
        pod = d["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == 120
        hook = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert hook[:3] == ["python3", "-c", DRAIN_SCRIPT]
        assert "http://127.0.0.1:8000/metrics=vllm:num_requests_running" in hook[5]
        assert 'pdpool_kv_connector|stat="leases_active"' in hook[5]  # KV leases released
    decode_pod = out[("Deployment", "qwen-decode")]["spec"]["template"]["spec"]
    engine_hook = decode_pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert "http://127.0.0.1:8080/metrics=pdpool_sidecar_in_flight" in engine_hook
    assert decode_pod["containers"][1]["lifecycle"]["preStop"]  # the sidecar drains too
    assert out[("Deployment", "qwen-gateway")]["spec"]["replicas"] == 1
    assert not [k for k in out if k[0] == "HorizontalPodAutoscaler"]


def test_without_autoscaling_replicas_are_the_specs_and_pods_drain_for_the_rollout_grace():
    pool = parse_pool_spec("qwen", pool_manifest("qwen")["spec"])
    for m in build_children(REF, pool):
        assert m["kind"] != "HorizontalPodAutoscaler"
        if m["kind"] == "Deployment":
            assert "replicas" in m["spec"]
            if m["metadata"]["name"] != "qwen-gateway":
                pod = m["spec"]["template"]["spec"]
                assert pod["terminationGracePeriodSeconds"] == pool.rollout.drain_seconds


def test_hpa_mode_renders_one_hpa_per_role_with_the_same_bounds_and_behavior():
    out = children(
        mode="hpa",
        behavior={
            "scaleDownStabilizationSeconds": 300,
            "maxStepDown": 1,
            "downCooldownSeconds": 60,
        },
        hpa={"decodeMetric": {"name": "vllm:num_requests_running", "averageValue": 16}},
    )
    decode = out[("HorizontalPodAutoscaler", "qwen-decode")]["spec"]
    assert decode["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "qwen-decode",
    }
    assert (decode["minReplicas"], decode["maxReplicas"]) == (1, 4)
    assert decode["metrics"][0]["pods"] == {
        "metric": {"name": "vllm:num_requests_running"},
        "target": {"type": "AverageValue", "averageValue": "16"},
    }
    assert decode["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 300,
        "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
    }
    prefill = out[("HorizontalPodAutoscaler", "qwen-prefill")]["spec"]
    assert prefill["metrics"][0]["pods"]["metric"]["name"] == "vllm:num_requests_waiting"
    assert "replicas" not in out[("Deployment", "qwen-decode")]["spec"]


def test_operator_render_shows_the_hpas(tmp_path):
    import yaml

    manifest = pool_manifest("qwen", autoscaling={**SCALING, "mode": "hpa"})
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(manifest))
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pdpool.cli import main; sys.exit(main())",
            "operator",
            "render",
            "-f",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(done.stdout)]
    assert kinds.count("HorizontalPodAutoscaler") == 2


class _Metrics(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def _drain(body: bytes, limit_s: float) -> float:
    _Metrics.body = body
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    import time

    start = time.monotonic()
    try:
        subprocess.run(
            [
                sys.executable,
                "-c",
                DRAIN_SCRIPT,
                "0",
                str(limit_s),
                f'{url}=vllm:num_requests_running,pdpool_kv_connector|stat="leases_active"',
            ],
            check=True,
            timeout=30,
        )
    finally:
        server.shutdown()
    return time.monotonic() - start


def test_drain_script_waits_while_requests_or_leases_remain_and_not_otherwise():
    running = b'vllm:num_requests_running{model_name="m"} 0.0\n'
    idle = running + b'pdpool_kv_connector{stat="leases_active"} 0.0\n'
    idle += b'pdpool_kv_connector{stat="bytes_read"} 99.0\n'
    busy = running + b'pdpool_kv_connector{stat="leases_active"} 2.0\n'
    assert _drain(idle, 3.0) < 2.0  # other connector stats do not count
    assert _drain(busy, 3.0) >= 3.0  # a KV lease held: waits (here until its limit)


def test_scrape_targets_are_running_pods_engines_and_decode_sidecars():
    def pod(name, role, phase="Running", ip="10.0.0.9", deleting=False):
        meta = {"name": name, "namespace": "ns", "labels": {"pdpool.io/role": role}}
        if deleting:
            meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        return {"metadata": meta, "status": {"phase": phase, "podIP": ip}}

    pods = [
        pod("p-1", "prefill"),
        pod("d-1", "decode"),
        pod("d-2", "decode", phase="Pending"),
        pod("d-3", "decode", deleting=True),
        pod("g-1", "gateway"),
    ]
    targets = scrape_targets(pods, "{scheme}://{ip}:{port}/metrics")
    assert [(t.role, t.url) for t in targets] == [
        ("prefill", "http://10.0.0.9:8000/metrics"),
        ("decode", "http://10.0.0.9:8000/metrics"),
        ("sidecar", "http://10.0.0.9:8080/metrics"),
    ]


class RecordingCluster:
    """The five calls the planner loop makes, recorded (the loop's own logic under test;
    the real API server answers them in test_operator_autoscaling.py)."""

    def __init__(self):
        self.replicas = {"prefill": 1, "decode": 1}
        self.applied, self.events, self.status = [], [], {}

    def list_deployments(self, namespace, selector):
        return [
            {"metadata": {"labels": {"pdpool.io/role": r}}, "spec": {"replicas": n}}
            for r, n in self.replicas.items()
        ]

    def list_pods(self, namespace, selector):
        return []

    def apply_as(self, manifest, manager):
        role = manifest["metadata"]["name"].rsplit("-", 1)[1]
        self.replicas[role] = manifest["spec"]["replicas"]
        self.applied.append((manager, role, manifest["spec"]["replicas"]))
        return manifest

    def patch_pool_status(self, namespace, name, status):
        self.status = status

    def create_event(self, namespace, event):
        self.events.append(event)


SLOW_DECODE = """# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{le="0.05"} 0
vllm:inter_token_latency_seconds_bucket{le="1.0"} N
vllm:inter_token_latency_seconds_bucket{le="+Inf"} N
vllm:inter_token_latency_seconds_count N
vllm:inter_token_latency_seconds_sum 0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running 4
"""


def test_planner_loop_scales_a_slow_role_posts_an_event_and_reports_status():
    cluster, clock = RecordingCluster(), [0.0]
    seen = [0]

    def scrape(targets):
        seen[0] += 100
        text = SLOW_DECODE.replace("N", str(seen[0]))
        return Snapshot(0.0, (EndpointMetrics("decode", "d-1:8000", parse_text(text)),))

    pool = parse_pool_spec("qwen", spec(behavior={"intervalSeconds": 5, "upCooldownSeconds": 0}))
    loop = Autoscaler(cluster, scrape=scrape, clock=lambda: clock[0])
    assert not loop.tick(REF, pool).changed  # first scrape: no window yet
    assert loop.tick(REF, pool) is None  # not due before intervalSeconds
    clock[0] = 5.0
    decision = loop.tick(REF, pool)
    assert decision.decode.desired == 3 and "itl" in decision.decode.reason  # max step 2
    assert cluster.applied == [("pdpool-autoscaler", "decode", 3)]
    assert cluster.events[0]["reason"] == "Scaled"
    assert cluster.events[0]["message"].startswith("decode 1 -> 3: itl at")
    assert cluster.status["autoscaling"]["decode"]["desired"] == 3
    assert cluster.status["autoscaling"]["inputs"]["decode"]["itl_p90"] > 0.5
    assert cluster.status["autoscaling"]["lastScaleTime"]


def test_keda_mode_renders_one_scaled_object_per_role_on_prometheus():
    out = children(
        mode="keda",
        keda={"prometheusAddress": "http://prometheus.monitoring:9090"},
        behavior={"intervalSeconds": 20, "scaleDownStabilizationSeconds": 300},
        hpa={"prefillMetric": {"name": "vllm:num_requests_waiting", "averageValue": "2500m"}},
    )
    decode = out[("ScaledObject", "qwen-decode")]
    assert decode["apiVersion"] == "keda.sh/v1alpha1"
    spec_ = decode["spec"]
    assert spec_["scaleTargetRef"]["name"] == "qwen-decode"
    assert (spec_["minReplicaCount"], spec_["maxReplicaCount"]) == (1, 4)
    assert spec_["pollingInterval"] == 20
    behavior = spec_["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 300
    (trigger,) = spec_["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"] == {
        "serverAddress": "http://prometheus.monitoring:9090",
        "query": "sum(vllm:kv_cache_usage_perc"
        '{namespace="ns",pod=~"qwen-decode-[a-z0-9]+-[a-z0-9]+"})',
        "threshold": "0.85",  # the default 850m, as KEDA's plain decimal
    }
    prefill = out[("ScaledObject", "qwen-prefill")]["spec"]["triggers"][0]["metadata"]
    assert prefill["threshold"] == "2.5"
    assert not any(kind == "HorizontalPodAutoscaler" for kind, _ in out)
    assert "replicas" not in out[("Deployment", "qwen-decode")]["spec"]


def test_keda_scale_to_zero_and_own_queries():
    out = children(
        mode="keda",
        prefill={"min": 0, "max": 2},
        scaleToZero=True,
        keda={"prometheusAddress": "https://prom:9090", "prefillQuery": "sum(my_series)"},
    )
    prefill = out[("ScaledObject", "qwen-prefill")]["spec"]
    assert prefill["minReplicaCount"] == 0  # KEDA activates it again from the query
    assert prefill["triggers"][0]["metadata"]["query"] == "sum(my_series)"


@pytest.mark.parametrize(
    ("autoscaling", "message"),
    [
        ({"mode": "keda"}, "keda.prometheusAddress is required with mode keda"),
        ({"mode": "keda", "keda": {"prometheusAddress": "prom:9090"}}, "http"),
        (
            {"mode": "keda", "keda": {"prometheusAddress": "http://p", "decodeQuery": " "}},
            "decodeQuery must be a non-empty PromQL string",
        ),
        ({"mode": "kubectl"}, "mode must be one of planner, hpa, keda"),
    ],
)
def test_keda_refusals_name_the_field(autoscaling, message):
    with pytest.raises(SpecError, match=message):
        parse_pool_spec("qwen", spec(**autoscaling))


@pytest.mark.parametrize(
    ("mode", "retired"),
    [
        ("planner", {"HorizontalPodAutoscaler", "ScaledObject"}),
        ("hpa", {"ScaledObject"}),
        ("keda", {"HorizontalPodAutoscaler"}),
        (None, {"HorizontalPodAutoscaler", "ScaledObject"}),
    ],
)
def test_each_mode_retires_the_other_modes_autoscalers(mode, retired):
    from pdpool.operator.builders import retired_autoscalers

    over = {"keda": {"prometheusAddress": "http://p"}} if mode == "keda" else {}
    manifest = spec(mode=mode, **over) if mode else pool_manifest("qwen")["spec"]
    pool = parse_pool_spec("qwen", manifest)
    got = retired_autoscalers(REF, pool)
    assert {m["kind"] for m in got} == retired
    assert {m["metadata"]["name"] for m in got} == {"qwen-prefill", "qwen-decode"}


def test_the_planner_scrapes_the_metrics_ports_the_network_policy_admits_it_to():
    """Pods as the operator renders them: engines and sidecars on their named metrics
    ports (the planner is a scraper: metricsFrom admits it there, not to 8000/8080)."""
    from pdpool.operator.builders import build_children
    from pdpool.operator.children import PoolRef
    from pdpool.operator.spec import parse_pool_spec

    def running(template, name):
        return {
            "metadata": {"name": name, "namespace": "ns", **template["metadata"]},
            "spec": template["spec"],
            "status": {"phase": "Running", "podIP": "10.0.0.7"},
        }

    for kind, engine_port in (("pdpool", 9090), ("vllm", 8000)):
        spec = {"model": {"path": "/m"}, "engine": {"image": "e:1", "kind": kind}}
        kids = build_children(PoolRef("demo", "ns", "u"), parse_pool_spec("demo", spec))
        deployments = {m["metadata"]["name"]: m for m in kids if m["kind"] == "Deployment"}
        pods = [
            running(deployments[f"demo-{role}"]["spec"]["template"], f"{role}-1")
            for role in ("prefill", "decode")
        ]
        targets = scrape_targets(pods, "{scheme}://{ip}:{port}/metrics")
        assert [(t.role, t.url) for t in targets] == [
            ("prefill", f"http://10.0.0.7:{engine_port}/metrics"),
            ("decode", f"http://10.0.0.7:{engine_port}/metrics"),
            ("sidecar", "http://10.0.0.7:9091/metrics"),
        ], kind
