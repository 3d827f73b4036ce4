"""`pdpool serve` on CPU leaves one core to its HTTP server unless told otherwise: the
policy's arithmetic, the cgroup limit it reads, and a real server that applies it."""

from __future__ import annotations

import argparse
import re

import pytest

from devtools.engine_procs import EngineProcess
from pdpool.engine import serve_cli
from pdpool.engine.cpu_threads import cgroup_quota_cores, serving_cpu_threads, usable_cores


@pytest.mark.parametrize("cores,threads", [(1, 1), (2, 1), (3, 2), (16, 15)])
def test_all_cores_but_one_for_the_model(cores, threads):
    assert serving_cpu_threads(cores, environ={}) == threads


def test_omp_num_threads_decides_when_set():
    assert serving_cpu_threads(8, environ={"OMP_NUM_THREADS": "3"}) is None


@pytest.mark.parametrize(
    "content,cores",
    [("max 100000\n", None), ("200000 100000\n", 2), ("150000 100000\n", 2), ("5000 100000", 1)],
)
def test_cgroup_cpu_limit_in_whole_cores(tmp_path, content, cores):
    path = tmp_path / "cpu.max"
    path.write_text(content)
    assert cgroup_quota_cores(str(path)) == cores


def test_unreadable_cgroup_file_means_no_limit(tmp_path):
    assert cgroup_quota_cores(str(tmp_path / "absent")) is None
    (tmp_path / "bad").write_text("garbage")
    assert cgroup_quota_cores(str(tmp_path / "bad")) is None


def test_a_cgroup_limit_caps_the_usable_cores(tmp_path):
    path = tmp_path / "cpu.max"
    path.write_text("100000 100000\n")
    assert usable_cores(str(path)) == 1


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    return p.parse_args(["model-dir", *argv])


def test_serve_passes_the_policy_unless_cpu_threads_is_given(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert serve_cli.config_from_args(_args()).cpu_threads == max(1, usable_cores() - 1)
    assert serve_cli.config_from_args(_args("--cpu-threads", "3")).cpu_threads == 3


def test_a_served_engine_runs_with_the_policys_threads(tiny_qwen3, tmp_path, monkeypatch):
    # EngineProcess pins OMP_NUM_THREADS=1 for tests; an explicit --cpu-threads wins over it,
    # and the engine says what it applied.
    eng = EngineProcess(tiny_qwen3, tmp_path, "--cpu-threads", "2", "--log-level", "info")
    try:
        eng.wait()
    finally:
        eng.stop()
    line = next(x for x in eng.log.read_text().splitlines() if "engine ready" in x)
    assert re.search(r"\b2 threads\b", line), line
