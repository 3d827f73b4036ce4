"""UCX's TCP listeners follow --kv-host: an engine that peers reach at a loopback address
listens on loopback only (before, UCX opened a listener on every network device, where a
one-sided READ of the engine's KV memory needs no lease). Each case runs in a fresh
process: UCX reads its environment once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("nixl")
pytest.importorskip("torch")

PROGRAM = """
import json, os, sys
import torch
from pdpool.engine.connector.nixl_transport import NixlTransport
from tests.support.listeners import listeners
t = NixlTransport("probe", host=sys.argv[1] or None)
t.register_region("kv", torch.zeros(4, 64))
print(json.dumps({"env": os.environ.get("UCX_NET_DEVICES"),
                  "at": sorted(s.address for s in listeners({os.getpid()}))}))
"""


def _probe(host: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, host],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_a_loopback_kv_host_keeps_ucx_on_loopback(host):
    got = _probe(host)
    assert got["env"] == "lo"
    assert got["at"] and all(a in ("127.0.0.1", "::1") for a in got["at"]), got


def test_an_explicit_device_choice_stands():
    assert _probe("127.0.0.1", UCX_NET_DEVICES="all")["env"] == "all"
