"""The suite's order (tests/conftest.py): the tests that wait on the longest cold builds run
last, so that .ci/run's builds, started beside the suite, finish while the rest runs; the
Kubernetes binaries' tests before the images' (the cluster tier's); each file in one piece."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import LATE_BUILDS, run_rank

REPO = Path(__file__).resolve().parents[1]


def collected_files(*paths: str) -> list[str]:
    """Each test's file, in the order a full run (the cluster tier on) would run them."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
        cwd=REPO,
        env={**os.environ, "PDPOOL_CLUSTER_TIER": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line.split("::")[0] for line in done.stdout.splitlines() if "::" in line]


def test_long_builds_run_last_in_their_order_and_files_stay_whole():
    files = collected_files(
        "tests/cluster", "tests/operator", "tests/test_ports.py", "tests/vllm/test_vllm_render.py"
    )
    runs = [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]
    assert len(runs) == len(set(runs)), f"a file was split: {runs}"
    operator_k8s = {
        "tests/operator/test_operator_cluster.py",
        "tests/operator/test_operator_helm.py",
    }
    cluster = {"tests/cluster/test_pool.py", "tests/cluster/test_host_state.py"}
    needs_none = {
        "tests/test_ports.py",
        "tests/vllm/test_vllm_render.py",
        "tests/operator/test_operator_netpol.py",  # the operator's pure builders
    }
    assert {*operator_k8s, *cluster, *needs_none} <= set(runs)
    place = {f: i for i, f in enumerate(runs)}
    assert max(place[f] for f in needs_none) < min(place[f] for f in operator_k8s)
    assert max(place[f] for f in operator_k8s) < min(place[f] for f in cluster)
    assert runs[-len(cluster) - 1 :] == [r for r in runs if r.startswith("tests/cluster/")][-4:]


class _Item:
    def __init__(self, *scripts: str):
        self.scripts = scripts

    def iter_markers(self, name):
        assert name == "waits_for_build"
        return [pytest.mark.waits_for_build(s).mark for s in self.scripts]


def test_run_rank_is_the_latest_build_a_test_waits_for():
    assert run_rank(_Item()) == 0
    assert run_rank(_Item("k8s/build-binaries.sh")) == 1
    assert run_rank(_Item("images/build.sh", "k8s/build-binaries.sh")) == len(LATE_BUILDS)
    with pytest.raises(ValueError):  # a build the order does not know is a mistake, not last
        run_rank(_Item("nothing/build.sh"))
