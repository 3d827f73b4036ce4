"""What users run, on a real node: `helm install` the chart (the operator pod from the slim
image, with the chart's RBAC), `kubectl apply` a PDInferencePool of the tiny model (mounted
from the host through a PersistentVolume), prefill and decode pods Ready, requests through
the gateway Service's ClusterIP taking the P/D path with one engine's greedy text, a decode
pod deleted mid-stream while the stream completes, and `helm uninstall` leaving nothing."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import yaml

from tests.cluster.conftest import ENGINE, REPO, SLIM, Cluster

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(1800)]

NS, OP_NS, POOL = "pools", "pdpool-system", "tiny"
FORWARD = REPO / "scripts/cluster/netns_forward.py"
PROMPT = "The quick brown fox jumps over the lazy dog and then"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Forward:
    """A host port forwarded into the node's network namespace (a ClusterIP or a pod IP)."""

    def __init__(self, cluster: Cluster, target: str):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(FORWARD),
                f"/proc/{cluster.node_pid}/ns/net",
                f"127.0.0.1:{self.port}={target}",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def helm_bin() -> str:
    from tests.support.prerequisites import built_by

    return str(Path(built_by("k8s/build-binaries.sh", 3000)) / "helm")


def helm(cluster: Cluster, *args: str, timeout: float = 300) -> str:
    done = subprocess.run(
        [helm_bin(), *args], env=cluster.env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"helm {' '.join(args)}: {done.stderr.strip()}"
    return done.stdout


def pool_manifest(decode_replicas: int) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "pdpool.io/v1alpha1",
            "kind": "PDInferencePool",
            "metadata": {"name": POOL, "namespace": NS},
            "spec": {
                "model": {"path": "tiny-qwen3", "pvc": "models"},
                "engine": {"image": ENGINE, "imagePullPolicy": "Never"},
                "router": {"image": SLIM, "mode": "decode-first", "cacheHitThreshold": 0.5},
                "prefill": {"replicas": 1},
                "decode": {"replicas": decode_replicas},
            },
        }
    )


def model_volume(model_dir: Path) -> str:
    return yaml.safe_dump_all(
        [
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": "pdpool-tiny-models"},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "",
                    "persistentVolumeReclaimPolicy": "Retain",
                    "hostPath": {"path": str(model_dir), "type": "Directory"},
                    "claimRef": {"namespace": NS, "name": "models"},
                },
            },
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "models", "namespace": NS},
                "spec": {
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "",
                    "volumeName": "pdpool-tiny-models",
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            },
        ]
    )


def pods(cluster: Cluster, role: str) -> list[dict]:
    out = cluster.kubectl("get", "pods", "-n", NS, "-l", f"pdpool.io/role={role}", "-o", "json")
    return [
        p for p in json.loads(out.stdout)["items"] if not p["metadata"].get("deletionTimestamp")
    ]


def ready_seconds(pod: dict) -> float | None:
    """Seconds from the pod's creation to its Ready condition, None while not Ready."""
    for c in pod["status"].get("conditions", []):
        if c["type"] == "Ready" and c["status"] == "True":
            t = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
            return (
                t(c["lastTransitionTime"]) - t(pod["metadata"]["creationTimestamp"])
            ).total_seconds()
    return None


def wait_ready(cluster: Cluster, role: str, count: int, timeout: float = 600) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = pods(cluster, role)
        if len(found) == count and all(ready_seconds(p) is not None for p in found):
            return found
        time.sleep(2)
    events = cluster.kubectl("get", "events", "-n", NS, "--sort-by=.lastTimestamp").stdout[-3000:]
    raise AssertionError(f"{count} {role} pods not Ready in {timeout} s:\n{events}")


def sidecar_paths(cluster: Cluster) -> dict[str, float]:
    """pdpool_sidecar_requests by path, summed over the decode pods (their sidecars' metrics)."""
    total: dict[str, float] = {}
    for p in pods(cluster, "decode"):
        name = p["metadata"]["name"]
        text = cluster.kubectl(
            "get", "--raw", f"/api/v1/namespaces/{NS}/pods/{name}:9091/proxy/metrics"
        ).stdout
        for m in re.finditer(
            r'^pdpool_sidecar_requests_total\{[^}]*path="(\w+)"[^}]*\} (\S+)', text, re.M
        ):
            total[m.group(1)] = total.get(m.group(1), 0.0) + float(m.group(2))
    return total


def complete(url: str, max_tokens: int = 16, **extra) -> dict:
    body = {
        "model": "tiny-qwen3",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def installed(pool_cluster: Cluster, tiny_qwen3: Path, tmp_path_factory) -> Iterator[dict]:
    cluster = pool_cluster
    models = tmp_path_factory.mktemp("cluster-models")
    shutil.copytree(tiny_qwen3, models / "tiny-qwen3")
    subprocess.run(["chmod", "-R", "a+rX", str(models)], check=True)
    models.chmod(0o755)
    cluster.kubectl("create", "namespace", NS)
    cluster.kubectl("apply", "-f", "-", input=model_volume(models))
    t0 = time.monotonic()
    helm(
        cluster,
        "install",
        "pdpool",
        str(REPO / "charts/pdpool-operator"),
        "-n",
        OP_NS,
        "--create-namespace",
        "--set",
        "image.repository=localhost/pdpool-slim",
        "--set",
        "image.tag=dev",
        "--set",
        "image.pullPolicy=Never",
        "--set",
        f"watchNamespaces={{{NS}}}",
        "--wait",
        "--timeout",
        "5m",
    )
    operator_ready_s = time.monotonic() - t0
    t0 = time.monotonic()
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(2))
    times = {
        "operator_helm_install_wait_s": round(operator_ready_s, 1),
        "prefill": [ready_seconds(p) for p in wait_ready(cluster, "prefill", 1)],
        "decode": [ready_seconds(p) for p in wait_ready(cluster, "decode", 2)],
        "gateway": [ready_seconds(p) for p in wait_ready(cluster, "gateway", 1)],
    }
    times["apply_to_all_ready_s"] = round(time.monotonic() - t0, 1)
    print(f"\npod Ready times (s from creation): {json.dumps(times)}")
    svc = json.loads(
        cluster.kubectl("get", "svc", "-n", NS, f"{POOL}-gateway", "-o", "json").stdout
    )
    gateway = Forward(cluster, f"{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}")
    try:
        yield {"cluster": cluster, "gateway": gateway.url, "times": times}
    finally:
        gateway.close()


def test_requests_through_the_gateway_service_take_the_pd_path_with_the_engines_text(installed):
    cluster: Cluster = installed["cluster"]
    before = sidecar_paths(cluster)
    via_gateway = complete(installed["gateway"])
    after = sidecar_paths(cluster)
    # Decode-first with threshold 0.5: a new prompt is rejected by decode, prefilled remotely.
    assert after.get("pd", 0) - before.get("pd", 0) == 1, (before, after)
    # One engine alone (a decode pod's engine, no P/D) gives the same greedy text.
    pod_ip = pods(cluster, "decode")[0]["status"]["podIP"]
    engine = Forward(cluster, f"{pod_ip}:8000")
    try:
        alone = complete(engine.url)
    finally:
        engine.close()
    text = via_gateway["choices"][0]["text"]
    print(f"\nP/D text {text!r} == engine alone {alone['choices'][0]['text']!r}")
    assert text and text == alone["choices"][0]["text"]


def test_a_decode_pod_deleted_mid_stream_and_the_stream_completes(installed):
    cluster: Cluster = installed["cluster"]
    url = installed["gateway"]
    expected = complete(url, max_tokens=200, ignore_eos=True)["choices"][0]["text"]
    body = {
        "model": "tiny-qwen3",
        "prompt": PROMPT,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    victims = [p["metadata"]["name"] for p in pods(cluster, "decode")]
    pieces: list[str] = []
    finish = None
    deleted = False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk.get("choices", []):
                pieces.append(c.get("text") or "")
                finish = c.get("finish_reason") or finish
            if len(pieces) == 5 and not deleted:
                # Both decode pods: whichever serves the stream is gone mid-stream.
                cluster.kubectl("delete", "pod", "-n", NS, victims[0], "--wait=false")
                deleted = True
    assert deleted and finish == "length"
    print(f"\nstream across a deleted decode pod: {len(pieces)} chunks, finish {finish}")
    assert "".join(pieces) == expected


def test_helm_uninstall_leaves_nothing(installed):
    cluster: Cluster = installed["cluster"]
    cluster.kubectl("delete", "pdip", "-n", NS, POOL, "--wait=true", timeout=300)
    helm(cluster, "uninstall", "pdpool", "-n", OP_NS, "--wait")
    cluster.kubectl("delete", "pvc", "-n", NS, "models", "--wait=true")
    cluster.kubectl("delete", "pv", "pdpool-tiny-models", "--wait=true")
    left = []
    kinds = cluster.kubectl("api-resources", "--verbs=list", "-o", "name").stdout.split()
    namespaced = set(
        cluster.kubectl(
            "api-resources", "--verbs=list", "--namespaced=true", "-o", "name"
        ).stdout.split()
    )
    deadline = time.monotonic() + 120
    while True:
        left = []
        for kind in kinds:
            if (
                kind.startswith("events")
                or kind == "customresourcedefinitions.apiextensions.k8s.io"
            ):
                continue
            args = ["get", kind, "-o", "name"]
            args += ["-n", NS] if kind in namespaced else []
            names = cluster.kubectl(*args, check=False).stdout.split()
            if kind in namespaced:
                names += [
                    f"{OP_NS}/{n}"
                    for n in cluster.kubectl(
                        "get", kind, "-n", OP_NS, "-o", "name", check=False
                    ).stdout.split()
                ]
            # What every namespace has by itself.
            left += [
                n
                for n in names
                if ("pdpool" in n or "tiny" in n or n.startswith(OP_NS))
                and not re.search(r"(configmap/kube-root-ca.crt|serviceaccount/default)$", n)
            ]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(3)
    print(f"\nobjects left after helm uninstall: {len(left)} {left}")
    assert left == []
