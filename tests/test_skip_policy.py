"""Only missing CUDA hardware may skip a test: any other skip (a binary, a venv, an extra
the project's scripts could have built) is reported as a failure with its reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = "tests/support/skip_probe.py"


def run_probe(**env: str) -> subprocess.CompletedProcess:
    child_env = {k: v for k, v in os.environ.items() if k != "PDPOOL_ALLOW_SKIPS"}
    child_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", PROBE],
        cwd=REPO,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_skip_for_a_missing_binary_fails_with_its_reason():
    out = run_probe()
    assert out.returncode == 1, out.stdout
    assert "1 failed, 2 skipped, 1 xfailed" in out.stdout, out.stdout
    failed = [line for line in out.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "test_needs_a_binary_nobody_built" in failed[0], out.stdout
    assert "run scripts/frobnicator/build.sh" in out.stdout


def test_cuda_skips_and_gpu_marked_tests_stay_skips():
    out = run_probe()
    skipped = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 2, out.stdout
    assert any("needs a CUDA device" in line for line in skipped)
    assert any("the GPU machine is busy" in line for line in skipped)


def test_a_developer_may_allow_skips_explicitly():
    out = run_probe(PDPOOL_ALLOW_SKIPS="1")
    assert out.returncode == 0, out.stdout
    assert "3 skipped" in out.stdout and "1 xfailed" in out.stdout, out.stdout
