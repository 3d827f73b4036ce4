"""Third-party programs the suite runs (stock vLLM, Envoy, Prometheus), built on first use
by the project's own scripts into caches outside the repository, so that the README's test
command needs no step before it. The scripts are idempotent and hold a lock, so a second
session waits for the first one's build and later runs take a second. A build that fails
fails the tests that need it, with the script's last lines as the reason."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@functools.cache
def _build(script: str, timeout_s: int) -> tuple[bool, str]:
    """(built, the script's last stdout line or why it failed); failures are cached too, so
    one broken build costs the session one attempt, not one per test."""
    try:
        done = subprocess.run(
            [str(REPO / "scripts" / script)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return False, f"scripts/{script} did not finish in {timeout_s} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " | ".join(done.stderr.strip().splitlines()[-5:])
        return False, f"scripts/{script} failed (exit {done.returncode}): {tail}"
    return True, lines[-1]


def built_by(script: str, timeout_s: int) -> str:
    """The last line `scripts/<script>` prints (the path it built), building it first if it
    is not cached; fails the calling test with the build's reason when it cannot be built."""
    ok, out = _build(script, timeout_s)
    if not ok:
        pytest.fail(out, pytrace=False)
    return out


def envoy_for_children() -> None:
    """Sets PDPOOL_ENVOY_BIN (how `pdpool up --gateway envoy` finds Envoy) unless a developer
    set it: the install script's Envoy, installed first when it is not (or waited for when
    another run is installing it, which the script's lock serializes)."""
    if not os.environ.get("PDPOOL_ENVOY_BIN"):
        os.environ["PDPOOL_ENVOY_BIN"] = built_by("envoy/install.sh", timeout_s=600)
