"""A throwaway Kubernetes control plane on loopback, for tests and benchmarks.

Runs the real `etcd`, `kube-apiserver` (TLS with a self-made CA, static token auth, RBAC
authorization, service-account token signing) and, when built, `kube-controller-manager`
restricted to the garbage-collector and namespace controllers (owner references really
cascade; Deployment status stays whatever a test patches, since no pods ever run here).

With `workloads=True` the cluster runs workloads for real, without containers: the
controller-manager adds the deployment, replicaset, serviceaccount and disruption
controllers, `kube-scheduler` places pods, and `kwok` plays the kubelet of a few fake
nodes (pods go Running and Ready at once; deleted pods go away). Deployments then report
what their pods do, with no status patching.

Binaries come from `scripts/k8s/build-binaries.sh` (cached outside the repository).
"""

from __future__ import annotations

import os
import json
import secrets
import shutil
import subprocess
import time
import urllib.request
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from pdpool.ports import free_port
from pdpool.tlsutil import make_ca_and_certificate, openssl

REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "scripts" / "k8s" / "build-binaries.sh"
DEFAULT_BIN = Path(os.environ.get("PDPOOL_K8S_BIN", Path.home() / ".cache" / "pdpool" / "k8s-bin"))


class ClusterError(RuntimeError):
    pass


def build_binaries(tools: list[str], bin_dir: Path = DEFAULT_BIN, timeout: float = 3600) -> Path:
    """Run the build script (a no-op when everything is cached). Raises ClusterError."""
    env = {**os.environ, "PDPOOL_K8S_BIN": str(bin_dir)}
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT), *tools],
        env=env,
        timeout=timeout,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if proc.returncode != 0:
        raise ClusterError(
            f"building {tools} failed (exit {proc.returncode}):\n" + proc.stdout[-4000:]
        )
    return bin_dir


def make_certificates(d: Path) -> None:
    """CA, an API server serving cert for 127.0.0.1/localhost, a service-account key pair."""
    make_ca_and_certificate(
        d,
        "IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc",
        ca_cn="pdpool-test-ca",
        name="apiserver",
        cn="kube-apiserver",
        days=2,
    )
    openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


def kubeconfig_text(server: str, ca_file: Path, token: str, user: str = "admin") -> str:
    return f"""apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: {{server: "{server}", certificate-authority: "{ca_file}"}}
users:
- name: {user}
  user: {{token: "{token}"}}
contexts:
- name: local
  context: {{cluster: local, user: {user}}}
current-context: local
"""


@dataclass
class LocalCluster:
    work: Path
    bin_dir: Path = DEFAULT_BIN
    with_controller_manager: bool = True
    workloads: bool = False  # + scheduler, kwok fake nodes, deployment controllers
    nodes: int = 2
    server: str = ""
    admin_token: str = ""
    kubeconfig: Path = field(default=Path())
    ca_file: Path = field(default=Path())
    _procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def start(self, timeout: float = 120) -> "LocalCluster":
        """etcd + kube-apiserver, ready to serve; then call start_controllers()."""
        self.work.mkdir(parents=True, exist_ok=True)
        certs = self.work / "certs"
        make_certificates(certs)
        self.ca_file = certs / "ca.crt"
        self.admin_token = secrets.token_hex(16)
        tokens = self.work / "tokens.csv"
        tokens.write_text(f"{self.admin_token},admin,admin,system:masters\n")
        tokens.chmod(0o600)

        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        self._spawn(
            "etcd",
            [
                str(self.bin_dir / "etcd"),
                "--name",
                "pdpool-test",
                "--data-dir",
                str(self.work / "etcd"),
                "--listen-client-urls",
                etcd_url,
                "--advertise-client-urls",
                etcd_url,
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-cluster",
                f"pdpool-test=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",
                "--log-level",
                "warn",
            ],
        )
        self.server = f"https://127.0.0.1:{api_port}"
        self._spawn(
            "kube-apiserver",
            [
                str(self.bin_dir / "kube-apiserver"),
                "--etcd-servers",
                etcd_url,
                "--bind-address",
                "127.0.0.1",
                "--advertise-address",
                "127.0.0.1",
                "--secure-port",
                str(api_port),
                "--tls-cert-file",
                str(certs / "apiserver.crt"),
                "--tls-private-key-file",
                str(certs / "apiserver.key"),
                "--token-auth-file",
                str(tokens),
                "--authorization-mode",
                "RBAC",
                "--service-account-issuer",
                "https://kubernetes.default.svc",
                "--service-account-key-file",
                str(certs / "sa.pub"),
                "--service-account-signing-key-file",
                str(certs / "sa.key"),
                "--service-cluster-ip-range",
                "10.96.0.0/16",
                "--cert-dir",
                str(certs / "generated"),
                "--enable-priority-and-fairness=false",
                "--profiling=false",
                "-v",
                "0",
            ],
        )
        self._wait_ready(timeout)
        self.kubeconfig = self.work / "admin.kubeconfig"
        self.kubeconfig.write_text(kubeconfig_text(self.server, self.ca_file, self.admin_token))
        return self

    def start_controllers(self) -> "LocalCluster":
        """Start the garbage collector. Install CRDs first: the collector rediscovers API
        resources only every 30s, and owner references to a kind it has not discovered yet
        wait for that."""
        controllers = "garbagecollector,namespace,clusterrole-aggregation"
        if self.workloads:
            controllers += ",deployment,replicaset,serviceaccount,disruption"
        if self.with_controller_manager:
            self._spawn(
                "kube-controller-manager",
                [
                    str(self.bin_dir / "kube-controller-manager"),
                    "--kubeconfig",
                    str(self.kubeconfig),
                    "--controllers",
                    controllers,
                    "--leader-elect=false",
                    "--secure-port=0",
                    "-v",
                    "0",
                ],
            )
        if self.workloads:
            self._start_workloads()
        return self

    def _start_workloads(self) -> None:
        self._spawn(
            "kube-scheduler",
            [
                str(self.bin_dir / "kube-scheduler"),
                "--kubeconfig",
                str(self.kubeconfig),
                "--leader-elect=false",
                "--secure-port=0",
                "-v",
                "0",
            ],
        )
        self._spawn(
            "kwok",
            [
                str(self.bin_dir / "kwok"),
                "--kubeconfig",
                str(self.kubeconfig),
                "--config",
                str(self.bin_dir / "kwok-stages.yaml"),
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                "--cidr=10.244.0.1/16",
                "--node-ip=10.0.0.1",
            ],
        )
        for i in range(self.nodes):
            name = f"kwok-node-{i}"
            self.api("POST", "/api/v1/nodes", fake_node(name, zone=f"zone-{i % 2}"))
            # The API server taints new nodes not-ready; the node lifecycle controller (not
            # run: kwok sends no heartbeats it would trust) would lift it once Ready.
            self.api(
                "PATCH",
                f"/api/v1/nodes/{name}",
                {"spec": {"taints": None}},
                "application/merge-patch+json",
            )

    def api(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        content_type: str = "application/json",
    ) -> dict:
        """One call as the admin (JSON in and out), for setting the cluster up."""
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            f"{self.server}{path}",
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.admin_token}", "Content-Type": content_type},
        )
        with urllib.request.urlopen(req, context=ctx, timeout=30) as resp:
            return json.loads(resp.read() or b"{}")

    def _spawn(self, name: str, argv: list[str]) -> None:
        # The child holds its own copy of the log's descriptor: this one closes at once.
        with open(self.work / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._procs.append((name, proc))

    def _wait_ready(self, timeout: float) -> None:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for name, proc in self._procs:
                if proc.poll() is not None:
                    raise ClusterError(
                        f"{name} exited with {proc.returncode}:\n" + self.log_tail(name)
                    )
            req = urllib.request.Request(
                f"{self.server}/readyz", headers={"Authorization": f"Bearer {self.admin_token}"}
            )
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError as exc:
                last = str(exc)
            time.sleep(0.5)
        raise ClusterError(
            f"kube-apiserver not ready after {timeout}s ({last}):\n"
            + self.log_tail("kube-apiserver")
        )

    def log_tail(self, name: str, chars: int = 3000) -> str:
        path = self.work / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def write_kubeconfig(self, path: Path, token: str, user: str) -> Path:
        path.write_text(kubeconfig_text(self.server, self.ca_file, token, user))
        return path

    def stop(self) -> None:
        for _name, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
        for _name, proc in reversed(self._procs):
            try:
                proc.wait(timeout=5)  # a throwaway cluster: no need for a graceful drain
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()

    def remove(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def fake_node(name: str, zone: str, gpus: int = 8) -> dict:
    """A node kwok plays the kubelet of (its annotation), with GPUs to schedule on."""
    capacity = {
        "cpu": "64",
        "memory": "512Gi",
        "pods": "110",
        "nvidia.com/gpu": str(gpus),
        "ephemeral-storage": "1Ti",
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake"},
            "labels": {
                "kubernetes.io/hostname": name,
                "type": "kwok",
                "topology.kubernetes.io/zone": zone,
                "kubernetes.io/os": "linux",
            },
        },
        "status": {"capacity": capacity, "allocatable": capacity},
    }
