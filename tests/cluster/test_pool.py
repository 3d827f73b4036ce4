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

from tests.cluster.conftest import ENGINE, REPO, SLIM, Cluster, kube_bin

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cluster,
    pytest.mark.waits_for_build("images/build.sh"),
    pytest.mark.timeout(1800),
]

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
    return str(kube_bin() / "helm")


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
                # The served name stays when a rollout changes the model's revision.
                "model": {"path": "tiny-qwen3", "pvc": "models", "servedName": "tiny-qwen3"},
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


def wait_prefill_known(cluster: Cluster, timeout: float = 120) -> None:
    """Until every decode pod's sidecar has found every prefill pod (headless-Service DNS,
    refreshed every 5 s) and probed it healthy: before that a prompt is served by decode
    alone (the path `fallback`)."""
    deadline = time.monotonic() + timeout
    while True:
        prefill_ips = {p["status"].get("podIP") for p in pods(cluster, "prefill")}
        missing = []
        for p in pods(cluster, "decode"):
            text = cluster.kubectl(
                "get",
                "--raw",
                f"/api/v1/namespaces/{NS}/pods/{p['metadata']['name']}:9091/proxy/metrics",
                check=False,
            ).stdout
            healthy = set(
                re.findall(
                    r'^pdpool_sidecar_prefill_ejected\{endpoint="([^:"]+):\d+"\} 0', text, re.M
                )
            )
            missing += [ip for ip in prefill_ips if ip not in healthy]
        if not missing:
            return
        assert time.monotonic() < deadline, f"sidecars never found prefill pods {missing}"
        time.sleep(1)


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
        "prompt": extra.pop("prompt", PROMPT),
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
    from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model

    models = tmp_path_factory.mktemp("cluster-models")
    shutil.copytree(tiny_qwen3, models / "tiny-qwen3")
    # The same shapes with other weights: the revision the rolling update moves to.
    write_tiny_model(models / "tiny-qwen3-r2", TinyModelSpec(arch="qwen3", seed=9))
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
    wait_prefill_known(cluster)
    times["apply_to_prefill_known_s"] = round(time.monotonic() - t0, 1)
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
    # One engine alone (a decode pod's engine, no P/D) gives the same greedy text. Decode
    # engines reject prompts under the pool's cache-hit threshold (--global-cache-hit-
    # threshold) unless the request sets its own: 0, never rejected.
    pod_ip = pods(cluster, "decode")[0]["status"]["podIP"]
    engine = Forward(cluster, f"{pod_ip}:8000")
    try:
        alone = complete(engine.url, cache_hit_threshold=0.0)  # never rejected
    finally:
        engine.close()
    text = via_gateway["choices"][0]["text"]
    print(f"\nP/D text {text!r} == engine alone {alone['choices'][0]['text']!r}")
    assert text and text == alone["choices"][0]["text"]


def pod_metric(cluster: Cluster, pod: str, port: int, name: str, label: str = "") -> float:
    text = cluster.kubectl(
        "get", "--raw", f"/api/v1/namespaces/{NS}/pods/{pod}:{port}/proxy/metrics"
    ).stdout
    total = 0.0
    for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        if label in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def test_a_decode_pod_deleted_mid_stream_and_the_stream_completes(installed):
    cluster: Cluster = installed["cluster"]
    url = installed["gateway"]
    # Long enough (about 10 s here) to outlast the 1 s grace and the kubelet's 2 s more for
    # the preStop drain: the pod dies mid-stream and the gateway moves the stream.
    tokens = 4000
    expected = complete(url, max_tokens=tokens, ignore_eos=True)["choices"][0]["text"]
    gateway_pod = pods(cluster, "gateway")[0]["metadata"]["name"]
    migrations = "pdpool_gateway_migrations_total"
    migrated_before = pod_metric(cluster, gateway_pod, 9090, migrations, 'outcome="ok"')
    pieces: list[str] = []
    finish, victim = None, None
    for chunk in stream_chunks(url, PROMPT, tokens):
        for c in chunk.get("choices", []):
            pieces.append(c.get("text") or "")
            finish = c.get("finish_reason") or finish
        if len(pieces) == 20 and victim is None:
            # The decode pod serving this stream (its sidecar has it in flight) goes,
            # with a 1 s grace period: no time to finish its tokens.
            serving = [
                p["metadata"]["name"]
                for p in pods(cluster, "decode")
                if pod_metric(cluster, p["metadata"]["name"], 9091, "pdpool_sidecar_in_flight") > 0
            ]
            assert len(serving) == 1, serving
            victim = serving[0]
            cluster.kubectl("delete", "pod", "-n", NS, victim, "--grace-period=1", "--wait=false")
    migrated = pod_metric(cluster, gateway_pod, 9090, migrations, 'outcome="ok"') - migrated_before
    print(
        f"\nstream across deleted decode pod {victim}: {len(pieces)} chunks, "
        f"finish {finish}, gateway migrations {migrated:.0f}"
    )
    assert victim and finish == "length"
    assert "".join(pieces) == expected
    assert migrated == 1
    wait_ready(cluster, "decode", 2)  # the Deployment's replacement


def pool_object(cluster: Cluster) -> dict:
    return json.loads(cluster.kubectl("get", "pdip", "-n", NS, POOL, "-o", "json").stdout)


def patch_pool(cluster: Cluster, spec: dict) -> int:
    """Merges `spec` into the pool's spec; the pool's new generation."""
    cluster.kubectl(
        "patch", "pdip", "-n", NS, POOL, "--type", "merge", "-p", json.dumps({"spec": spec})
    )
    return int(pool_object(cluster)["metadata"]["generation"])


def condition(pool: dict, kind: str) -> dict:
    return next((c for c in pool.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def stream_chunks(url: str, prompt: str, max_tokens: int) -> Iterator[dict]:
    """The parsed chunks of a greedy stream (with a usage chunk at the end); none is an
    error."""
    body = {
        "model": "tiny-qwen3",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            yield chunk


def stream_text(url: str, prompt: str, max_tokens: int) -> tuple[str, str | None, int]:
    """(text, finish_reason, completion tokens from the usage chunk) of a greedy stream."""
    pieces, finish, tokens = [], None, -1
    for chunk in stream_chunks(url, prompt, max_tokens):
        for c in chunk.get("choices", []):
            pieces.append(c.get("text") or "")
            finish = c.get("finish_reason") or finish
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return "".join(pieces), finish, tokens


def in_flight(cluster: Cluster, pod: str) -> float:
    return pod_metric(cluster, pod, 9091, "pdpool_sidecar_in_flight")


def test_scaling_decode_down_drains_the_leaving_pod_before_it_goes(installed):
    """The pool's decode replicas go from 2 to 1 while a long stream runs on the pod that
    leaves: the pod stays (Terminating, out of the Service) until its stream has finished
    on it, with no migration, and only then goes."""
    import threading

    cluster: Cluster = installed["cluster"]
    url = installed["gateway"]
    gateway_pod = pods(cluster, "gateway")[0]["metadata"]["name"]
    migrations = "pdpool_gateway_migrations_total"
    migrated_before = pod_metric(cluster, gateway_pod, 9090, migrations)
    result: dict = {}

    prompt = PROMPT + " (drain)"
    # Long enough (several seconds here) to still run when the pod is told to go.
    expected = complete(url, max_tokens=3000, ignore_eos=True, prompt=prompt)
    expected_text = expected["choices"][0]["text"]

    def run() -> None:
        result["stream"] = stream_text(url, prompt, 3000)
        result["done_at"] = time.monotonic()

    streamer = threading.Thread(target=run)
    streamer.start()
    deadline = time.monotonic() + 60
    victim = None
    while victim is None and time.monotonic() < deadline:
        busy = [p["metadata"]["name"] for p in pods(cluster, "decode")]
        busy = [name for name in busy if in_flight(cluster, name) > 0]
        victim = busy[0] if busy else None
        time.sleep(0.2)
    assert victim, "the stream never showed on a decode pod"
    # The ReplicaSet removes the pod of lowest deletion cost first: the busy one.
    cluster.kubectl(
        "annotate", "pod", "-n", NS, victim, "controller.kubernetes.io/pod-deletion-cost=-100"
    )
    patch_pool(cluster, {"decode": {"replicas": 1}})
    terminating_seen = False
    while streamer.is_alive():
        out = cluster.kubectl("get", "pod", "-n", NS, victim, "-o", "json", check=False)
        if out.returncode == 0 and json.loads(out.stdout)["metadata"].get("deletionTimestamp"):
            terminating_seen = True
        elif out.returncode != 0:
            break  # gone: only after the stream, or the assertions below fail
        time.sleep(0.5)
    streamer.join(timeout=600)
    gone_wait = time.monotonic()
    while cluster.kubectl("get", "pod", "-n", NS, victim, check=False).returncode == 0:
        assert time.monotonic() - gone_wait < 120, f"{victim} stayed after its stream"
        time.sleep(0.5)
    text, finish, tokens = result["stream"]
    migrated = pod_metric(cluster, gateway_pod, 9090, migrations) - migrated_before
    print(
        f"\nscale-down drain: {victim} Terminating while its stream ran ({tokens} tokens, "
        f"finish {finish}), gone {time.monotonic() - gone_wait:.1f} s after it, migrations "
        f"{migrated:.0f}"
    )
    assert terminating_seen and finish == "length" and tokens == 3000
    assert text == expected_text
    assert migrated == 0  # drained on its pod, not moved
    assert len(pods(cluster, "decode")) == 1
    assert pool_object(cluster)["status"]["decode"]["replicas"] == 1
    patch_pool(cluster, {"decode": {"replicas": 2}})
    wait_ready(cluster, "decode", 2)


class Load:
    """Requests through the gateway from two threads until stopped: streamed and not, new
    prompts and repeated ones; every answer must be whole."""

    def __init__(self, url: str) -> None:
        import threading

        self.url, self.sent, self.failed = url, 0, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(2)]
        for t in self._threads:
            t.start()

    def _run(self, worker: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            prompt = f"{PROMPT} {worker} {i % 7 if i % 2 else i}"
            try:
                if i % 2:
                    _text, finish, tokens = stream_text(self.url, prompt, 24)
                    assert finish == "length" and tokens == 24, (finish, tokens)
                else:
                    out = complete(self.url, max_tokens=24, ignore_eos=True, prompt=prompt)
                    assert out["choices"][0]["finish_reason"] == "length", out
                    assert out["usage"]["completion_tokens"] == 24, out
            except Exception as exc:  # every failure is counted and shown
                self.failed.append(f"{type(exc).__name__}: {str(exc)[:300]}")
            self.sent += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=600)


def test_a_rolling_update_under_load_fails_no_request_and_never_hands_kv_across_revisions(
    installed,
):
    """The pool moves to another revision of its model (same served name) while requests
    flow: prefill and decode pods roll (a new pod Ready before an old one goes, each old
    one drained), no request fails, the RolledOut condition reports the progress, and
    decode engines never use KV of the other revision (their sidecars skip prefill engines
    of another KV fingerprint; a lease that still crossed is refused and recomputed)."""
    cluster: Cluster = installed["cluster"]
    url = installed["gateway"]
    old_pods = {p["metadata"]["name"] for r in ("prefill", "decode") for p in pods(cluster, r)}
    skipped: dict[str, float] = {}
    refused: dict[str, float] = {}
    progress: list[str] = []

    def scrape() -> None:
        for p in pods(cluster, "decode") + pods(cluster, "prefill"):
            name = p["metadata"]["name"]
            if ready_seconds(p) is None:
                continue
            try:
                if p["metadata"]["labels"]["pdpool.io/role"] == "decode":
                    skipped[name] = pod_metric(
                        cluster, name, 9091, "pdpool_sidecar_prefill_other_revision_skipped_total"
                    )
                    refused[name] = pod_metric(
                        cluster,
                        name,
                        8000,
                        "pdpool_kv_connector",
                        'stat="fingerprint_mismatches"',
                    )
            except AssertionError:
                pass  # going away between the listing and the scrape

    load = Load(url)
    try:
        time.sleep(5)
        started = time.monotonic()
        generation = patch_pool(cluster, {"model": {"path": "tiny-qwen3-r2"}})
        while True:
            scrape()
            pool = pool_object(cluster)
            rolled = condition(pool, "RolledOut")
            if rolled.get("message") and (not progress or progress[-1] != rolled["message"]):
                progress.append(rolled["message"])
            current = {
                p["metadata"]["name"] for r in ("prefill", "decode") for p in pods(cluster, r)
            }
            if (
                pool.get("status", {}).get("observedGeneration") == generation
                and rolled.get("status") == "True"
                and rolled.get("observedGeneration") == generation
                and not current & old_pods
            ):
                break
            assert time.monotonic() - started < 900, f"no rollout in 900 s: {progress[-3:]}"
            time.sleep(2)
        rolled_s = time.monotonic() - started
        time.sleep(5)
        scrape()
    finally:
        load.stop()
    # The new revision answers now: the gateway's text is a new decode engine's own.
    via_gateway = complete(url)["choices"][0]["text"]
    engine = Forward(cluster, f"{pods(cluster, 'decode')[0]['status']['podIP']}:8000")
    try:
        alone = complete(engine.url, cache_hit_threshold=0.0)["choices"][0]["text"]
    finally:
        engine.close()
    print(
        f"\nrolling update under load: {rolled_s:.0f} s, requests sent {load.sent}, "
        f"failed {len(load.failed)}; mixed-revision prefill engines skipped "
        f"{sum(skipped.values()):.0f}, leases refused {sum(refused.values()):.0f}; "
        f"progress seen: {progress}"
    )
    assert load.failed == [], load.failed[:5]
    assert load.sent >= 10
    assert any(
        "new replicas have been updated" in m or "pending termination" in m for m in progress
    )
    assert via_gateway == alone


def test_helm_upgrade_rolls_the_operator_and_leaves_the_pool_serving(installed):
    cluster: Cluster = installed["cluster"]
    before = {
        p["metadata"]["uid"] for r in ("prefill", "decode", "gateway") for p in pods(cluster, r)
    }
    operator_before = json.loads(cluster.kubectl("get", "pods", "-n", OP_NS, "-o", "json").stdout)[
        "items"
    ]
    helm(
        cluster,
        "upgrade",
        "pdpool",
        str(REPO / "charts/pdpool-operator"),
        "-n",
        OP_NS,
        "--reuse-values",
        "--set",
        "verbose=true",
        "--wait",
        "--timeout",
        "5m",
    )
    deadline = time.monotonic() + 120
    while True:
        operators = [
            p
            for p in json.loads(cluster.kubectl("get", "pods", "-n", OP_NS, "-o", "json").stdout)[
                "items"
            ]
            if not p["metadata"].get("deletionTimestamp")
        ]
        names = {p["metadata"]["name"] for p in operators}
        if names and not names & {p["metadata"]["name"] for p in operator_before}:
            break
        assert time.monotonic() < deadline, "the operator pod was not replaced"
        time.sleep(2)
    args = operators[0]["spec"]["containers"][0]["command"]
    assert "--verbose" in args
    # The new operator adopts the pool as it is: nothing of the pool is replaced.
    time.sleep(10)
    after = {
        p["metadata"]["uid"] for r in ("prefill", "decode", "gateway") for p in pods(cluster, r)
    }
    assert after == before
    assert complete(installed["gateway"])["choices"][0]["text"]
    assert condition(pool_object(cluster), "Ready").get("status") == "True"
    print(f"\nhelm upgrade: operator replaced, {len(before)} pool pods kept")


def test_helm_uninstall_leaves_nothing(installed):
    cluster: Cluster = installed["cluster"]
    cluster.kubectl("delete", "pdip", "-n", NS, POOL, "--wait=true", timeout=300)
    helm(cluster, "uninstall", "pdpool", "-n", OP_NS, "--wait")
    cluster.kubectl("delete", "pvc", "-n", NS, "models", "--wait=true")
    cluster.kubectl("delete", "pv", "pdpool-tiny-models", "--wait=true")
    kinds = cluster.kubectl("api-resources", "--verbs=list", "-o", "name").stdout.split()
    namespaced = set(
        cluster.kubectl(
            "api-resources", "--verbs=list", "--namespaced=true", "-o", "name"
        ).stdout.split()
    )
    # Not the release's: the node's own objects; the namespace `--create-namespace` made
    # (helm never deletes it); the CRD, which helm keeps by design (charts/*/crds), and the
    # APIService the API server registers for its group while it exists.
    theirs = re.compile(
        r"^(node/|csinode\.storage\.k8s\.io/|namespace/|"
        r"apiservice\.apiregistration\.k8s\.io/v1alpha1\.pdpool\.io$|"
        r".*/(configmap/kube-root-ca\.crt|serviceaccount/default)$)"
    )
    deadline = time.monotonic() + 120
    while True:
        left = []
        for kind in kinds:
            if kind.startswith("events") or kind.startswith("customresourcedefinitions"):
                continue
            if kind in namespaced:
                names = [
                    f"{ns}/{n}"
                    for ns in (NS, OP_NS)
                    for n in cluster.kubectl(
                        "get", kind, "-n", ns, "-o", "name", check=False
                    ).stdout.split()
                ]
            else:
                names = [
                    n
                    for n in cluster.kubectl("get", kind, "-o", "name", check=False).stdout.split()
                    if "pdpool" in n or "tiny" in n
                ]
            left += [n for n in names if not theirs.match(n)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(3)
    print(f"\nobjects left after helm uninstall: {len(left)} {left}")
    assert left == []
