"""Fixtures for the operator tests.

`k8s` builds (if needed) and starts a real etcd + kube-apiserver + kube-controller-manager
on loopback for the whole session. Only the cluster tests use it; the unit tests of the
pure builders never trigger a build. A failed build FAILS those tests; they are skipped
only when no Go toolchain exists at all and nothing is cached.
"""

from __future__ import annotations

import shutil
from pathlib import Path
import uuid

import pytest
from kubernetes import client

from devtools.devcluster import DEFAULT_BIN, LocalCluster, build_binaries
from devtools.operator_kube import OperatorProcess, Pools, api_client, install_crd

TOOLS = ["etcd", "kube-apiserver", "kube-controller-manager", "helm"]
WORKLOAD_TOOLS = [*TOOLS, "kube-scheduler", "kwok"]


def _build(tools):
    if not all((DEFAULT_BIN / t).exists() for t in tools) and shutil.which("go") is None:
        pytest.skip(f"go is not installed: cannot build {', '.join(tools)}")
    return build_binaries(tools)  # raises (the test fails) when a build fails


# Fixtures that start a control plane (or build its binaries): the full run's tier.
CLUSTER_FIXTURES = {"helm_bin", "k8s", "real_k8s", "admin_api", "operator_process"}


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents and CLUSTER_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.waits_for_build("k8s/build-binaries.sh"))


@pytest.fixture(scope="session")
def helm_bin():
    return _build(["helm"]) / "helm"


@pytest.fixture(scope="session")
def k8s(tmp_path_factory):
    bin_dir = _build(TOOLS)
    cluster = LocalCluster(work=tmp_path_factory.mktemp("k8s"), bin_dir=bin_dir)
    try:
        cluster.start()
        install_crd(api_client(cluster.server, cluster.ca_file, cluster.admin_token))
        cluster.start_controllers()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def real_k8s(tmp_path_factory):
    """A second cluster with workloads: deployment, replicaset, serviceaccount and
    disruption controllers, kube-scheduler, and kwok playing the kubelet of two fake GPU
    nodes (pods go Running and Ready at once). Shared by the modules that need pods."""
    bin_dir = _build(WORKLOAD_TOOLS)
    cluster = LocalCluster(
        work=tmp_path_factory.mktemp("k8s-real"), bin_dir=bin_dir, workloads=True
    )
    try:
        cluster.start()
        install_crd(api_client(cluster.server, cluster.ca_file, cluster.admin_token))
        cluster.start_controllers()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def admin_api(k8s):
    api = api_client(k8s.server, k8s.ca_file, k8s.admin_token)
    yield api
    api.close()


@pytest.fixture
def namespace(admin_api):
    name = f"t-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(admin_api)
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


@pytest.fixture
def pools(admin_api, namespace):
    return Pools(admin_api, namespace)


@pytest.fixture(scope="module")
def operator_process(k8s, tmp_path_factory):
    """A cluster-admin operator, shared by one test module (stopped at its end)."""
    op = OperatorProcess(k8s.kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    yield op
    op.stop()
    print("operator log (tail):\n" + op.log()[-4000:])  # shown when a test failed
