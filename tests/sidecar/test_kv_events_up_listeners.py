"""`pdpool up --kv-events` listens on loopback only: every TCP socket its process tree holds
open for listening (engines' HTTP, NIXL handshake and UCX listeners, KV-event PUB and
replay sockets, sidecars, gateway) is on 127.0.0.1 or ::1, after a request has crossed
prefill -> decode over NIXL. Printed as `ss -ltnp` would (`pytest -s`)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.e2e_helpers import engine_available
from tests.support.listeners import listeners, process_tree

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    if not engine_available():
        pytest.skip("pdpool engine (torch) is not installed")
    log_dir = tmp_path_factory.mktemp("up-listeners")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdpool.cli",
            "up",
            "--kv-events",
            "--port",
            "0",
            "--log-dir",
            str(log_dir),
            "--engine-arg=--num-kv-blocks=256",
            "--ready-timeout",
            "240",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    url, seen = None, []
    deadline = time.monotonic() + 300
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        m = re.search(r"OpenAI base URL: (\S+)/v1", line)
        url = m.group(1) if m else None
    try:
        assert url, "pdpool up did not get ready:\n" + "".join(seen[-30:])
        yield proc, url
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_every_listener_of_the_topology_is_on_loopback(up):
    proc, url = up
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    # A long prompt goes through prefill and a NIXL READ into the decode engine.
    prompt = list(range(3, 300))
    r = httpx.post(
        url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    found = listeners(process_tree(proc.pid))
    print("\nlistening TCP sockets of `pdpool up --kv-events` (as ss -ltnp):")
    print("\n".join(str(s) for s in found))
    commands = " ".join(s.command for s in found)
    # The topology is all there: gateway, sidecar, engines (serve), and each engine's
    # handshake, UCX and event listeners (more than one socket per engine process).
    assert all(word in commands for word in ("gateway", "sidecar", "serve")), commands
    assert len(found) >= 10, found
    assert [str(s) for s in found if not s.loopback] == []
