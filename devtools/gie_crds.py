"""The third-party CRDs a pool can render (Gateway API Inference Extension, Gateway API,
KEDA's ScaledObject), pinned and cached by scripts/gie/fetch-crds.sh, installed into a test
API server."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml
from kubernetes import client

from .operator_kube import REPO, wait_for

FETCH_SCRIPT = REPO / "scripts" / "gie" / "fetch-crds.sh"
# The kinds a pool with spec.inferencePool renders, and their CRD files.
CRD_FILES = (
    "inference.networking.k8s.io_inferencepools.yaml",
    "inference.networking.x-k8s.io_inferencemodelrewrites.yaml",
    "inference.networking.x-k8s.io_inferenceobjectives.yaml",
    "gateway.networking.k8s.io_httproutes.yaml",
    "gateway.networking.k8s.io_gateways.yaml",
)
# The kind a pool with autoscaling.mode keda renders.
KEDA_CRD_FILES = ("keda.sh_scaledobjects.yaml",)


def fetch_crds(timeout: float = 600) -> Path:
    """The folder of CRD YAML files (fetched once from the Go module proxy). Raises
    RuntimeError with the script's output when it fails."""
    done = subprocess.run(
        ["bash", str(FETCH_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{FETCH_SCRIPT} failed ({done.returncode}): {done.stderr[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def install_crds(api: client.ApiClient, folder: Path, files: tuple[str, ...] = CRD_FILES) -> None:
    """Creates each CRD (an existing one is left alone) and waits until it is served."""
    ext = client.ApiextensionsV1Api(api)
    for name in files:
        crd = yaml.safe_load((folder / name).read_text())
        try:
            ext.create_custom_resource_definition(crd)
        except client.ApiException as exc:
            if exc.status != 409:
                raise

        def established(crd_name: str = crd["metadata"]["name"]) -> bool:
            got = ext.read_custom_resource_definition(crd_name)
            return any(
                c.type == "Established" and c.status == "True"
                for c in (got.status.conditions or [])
            )

        wait_for(established, 30, what=f"CRD {name} established")
