"""The operator as a process, and PDInferencePool calls against a local API server
(devcluster), for the operator tests and benchmarks/operator_reconcile.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import yaml
from kubernetes import client

REPO = Path(__file__).resolve().parents[1]
CRD_FILE = REPO / "crds" / "pdinferencepools.pdpool.io.yaml"
CHART = REPO / "charts" / "pdpool-operator"
GROUP, VERSION, PLURAL = "pdpool.io", "v1alpha1", "pdinferencepools"
# The `pdpool` console script, run with this interpreter (`-m pdpool.cli` would load cli.py
# twice, as __main__ and as pdpool.cli, and CliError would not be caught).
PDPOOL = [sys.executable, "-c", "import sys; from pdpool.cli import main; sys.exit(main())"]


def api_client(server: str, ca_file: Path, token: str) -> client.ApiClient:
    config = client.Configuration()
    config.host = server
    config.ssl_ca_cert = str(ca_file)
    config.api_key = {"authorization": token}
    config.api_key_prefix = {"authorization": "Bearer"}
    return client.ApiClient(config)


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 30,
    interval: float = 0.2,
    what: str = "condition",
) -> Any:
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except client.ApiException as exc:
            last_error = exc
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what}"
        + (f" (last error: {last_error})" if last_error else "")
    )


def install_crd(api: client.ApiClient) -> None:
    crd = yaml.safe_load(CRD_FILE.read_text())
    ext = client.ApiextensionsV1Api(api)
    try:
        ext.create_custom_resource_definition(crd)
    except client.ApiException as exc:
        if exc.status != 409:
            raise

    def established():
        got = ext.read_custom_resource_definition(crd["metadata"]["name"])
        return any(
            c.type == "Established" and c.status == "True" for c in (got.status.conditions or [])
        )

    wait_for(established, 30, what="CRD established")


def pool_manifest(name: str, **spec_overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"path": "/models/qwen3"},
        "engine": {"image": "pdpool-engine:test"},
        "router": {"image": "pdpool-slim:test"},
    }
    spec.update(spec_overrides)
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PDInferencePool",
        "metadata": {"name": name},
        "spec": spec,
    }


class Pools:
    """PDInferencePool calls in one namespace."""

    def __init__(self, api: client.ApiClient, namespace: str):
        self.custom = client.CustomObjectsApi(api)
        self.apps = client.AppsV1Api(api)
        self.core = client.CoreV1Api(api)
        self.namespace = namespace

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return self.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, manifest
        )

    def get(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name
        )

    def patch_spec(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self.custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            name,
            {"spec": spec},
            _content_type="application/merge-patch+json",
        )

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)

    def deployments(self, pool: str) -> dict[str, Any]:
        items = self.apps.list_namespaced_deployment(
            self.namespace, label_selector=f"pdpool.io/pool={pool}"
        ).items
        return {d.metadata.labels["pdpool.io/role"]: d for d in items}

    def services(self, pool: str) -> dict[str, Any]:
        items = self.core.list_namespaced_service(
            self.namespace, label_selector=f"pdpool.io/pool={pool}"
        ).items
        return {s.metadata.name: s for s in items}

    def config_maps(self, pool: str) -> dict[str, Any]:
        items = self.core.list_namespaced_config_map(
            self.namespace, label_selector=f"pdpool.io/pool={pool}"
        ).items
        return {c.metadata.name: c for c in items}

    def secrets(self, pool: str) -> dict[str, Any]:
        items = self.core.list_namespaced_secret(
            self.namespace, label_selector=f"pdpool.io/pool={pool}"
        ).items
        return {s.metadata.name: s for s in items}

    def condition(self, name: str, kind: str) -> dict[str, Any] | None:
        status = self.get(name).get("status") or {}
        return next((c for c in status.get("conditions") or [] if c["type"] == kind), None)

    def mark_ready(self, pool: str, role: str, ready: int | None = None) -> None:
        """Stand-in for kubelet + deployment controller: report the rollout's outcome."""
        dep = self.apps.read_namespaced_deployment(f"{pool}-{role}", self.namespace)
        n = dep.spec.replicas if ready is None else ready
        self.apps.patch_namespaced_deployment_status(
            dep.metadata.name,
            self.namespace,
            {
                "status": {
                    "observedGeneration": dep.metadata.generation,
                    "replicas": dep.spec.replicas,
                    "readyReplicas": n,
                    "updatedReplicas": dep.spec.replicas,
                    "availableReplicas": n,
                }
            },
        )

    def events(self, name: str) -> list[Any]:
        return [
            e
            for e in self.core.list_namespaced_event(self.namespace).items
            if e.involved_object.name == name and e.involved_object.kind == "PDInferencePool"
        ]


CHILD_DEPLOYMENTS = {"prefill", "decode", "gateway"}


def children_exist(pools: Pools, name: str) -> bool:
    return (
        set(pools.deployments(name)) == CHILD_DEPLOYMENTS
        and set(pools.services(name)) == {f"{name}-{r}" for r in CHILD_DEPLOYMENTS}
        and set(pools.config_maps(name)) == {f"{name}-router"}
    )


class OperatorProcess:
    """`pdpool operator` as a subprocess, the way a container runs it."""

    def __init__(self, kubeconfig: Path, log_path: Path, *extra: str):
        self.kubeconfig, self.log_path, self.extra = kubeconfig, log_path, extra
        self.proc: subprocess.Popen | None = None

    def start(self) -> "OperatorProcess":
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:  # the child holds its own copy
            self.proc = subprocess.Popen(
                [
                    *PDPOOL,
                    "operator",
                    "--kubeconfig",
                    str(self.kubeconfig),
                    *(self.extra or ("--all-namespaces",)),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None
