"""The cluster tier: a real single-node cluster (scripts/cluster/up.sh: kubelet, containerd,
runc, CNI bridge, kube-proxy, CoreDNS) with the project's images (scripts/images/build.sh).
Needs root; a machine that cannot run it fails here with the reason, never skips."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.prerequisites import REPO, built_by

UP, DOWN = REPO / "scripts/cluster/up.sh", REPO / "scripts/cluster/down.sh"
SLIM, ENGINE = "localhost/pdpool-slim:dev", "localhost/pdpool-engine:dev"


@dataclass(frozen=True)
class Cluster:
    name: str
    dir: Path
    kubeconfig: Path
    env: dict[str, str]

    @property
    def node_pid(self) -> int:
        return int((self.dir / "node.pid").read_text())

    def kubectl(self, *args: str, timeout: float = 120, check: bool = True, **kw):
        done = subprocess.run(
            [str(kube_bin() / "kubectl"), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done


def kube_bin() -> Path:
    """The Kubernetes binaries (kubectl and helm among them), built by scripts/k8s."""
    return Path(built_by("k8s/build-binaries.sh", 3000))


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("the cluster tier needs root (a kubelet and containerd)", pytrace=False)


def cluster_env(name: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PDPOOL_CLUSTER_NAME"] = name
    env.pop("PDPOOL_CLUSTER_DIR", None)
    env["PDPOOL_CLUSTER_API_PORT"] = "0"
    return env


def images(*names: str) -> None:
    """The images (default: both), built or found up to date by scripts/images/build.sh."""
    if not names:
        built_by("images/build.sh", 5400)
        return
    done = subprocess.run(
        [str(REPO / "scripts/images/build.sh"), *names],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        pytest.fail(f"scripts/images/build.sh failed: {done.stderr.strip()[-1500:]}", pytrace=False)


def start(name: str, *image_refs: str) -> Cluster:
    env = cluster_env(name)
    done = subprocess.run(
        [str(UP), *image_refs], env=env, capture_output=True, text=True, timeout=1800
    )
    if done.returncode != 0:
        pytest.fail(f"scripts/cluster/up.sh failed: {done.stderr.strip()[-2000:]}", pytrace=False)
    kubeconfig = Path(done.stdout.strip().splitlines()[-1])
    env["KUBECONFIG"] = str(kubeconfig)
    return Cluster(name, kubeconfig.parent, kubeconfig, env)


def stop(cluster: Cluster) -> None:
    done = subprocess.run([str(DOWN)], env=cluster.env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"scripts/cluster/down.sh failed: {done.stderr.strip()}"


@pytest.fixture(scope="package")
def pool_cluster() -> Iterator[Cluster]:
    """One cluster with both images for the tier's pool tests (a fixed name, so that
    containerd's store keeps the imported images between runs), down once the tier's last
    test is done: its node's daemons would otherwise take CPU from every later test."""
    require_root()
    images()
    cluster = start("pdpool-tests", SLIM, ENGINE)
    try:
        yield cluster
    finally:
        stop(cluster)


def pytest_collection_modifyitems(config, items):
    """The tier runs when asked for: PDPOOL_CLUSTER_TIER=1 (.ci/run sets it), or a -m
    expression that names it (`python -m pytest -q -m cluster tests/cluster`). Otherwise it
    is deselected (not skipped), as it needs root and minutes of builds on a cold machine."""
    if os.environ.get("PDPOOL_CLUSTER_TIER") == "1" or "cluster" in (config.option.markexpr or ""):
        return
    keep = [i for i in items if i.get_closest_marker("cluster") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


def pytest_configure(config):
    # Registered here, not in pyproject.toml: pyproject.toml is part of the images' build
    # context, and a marker is no reason to rebuild them.
    config.addinivalue_line(
        "markers", "cluster: needs root and a real single-node cluster (scripts/cluster/up.sh)"
    )
