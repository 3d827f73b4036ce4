"""`pdpool up --tls` end to end: real engines, sidecar and gateway, every hop HTTPS with
the topology's own CA; the gateway's answer equals one aggregated engine's (greedy), and
plain HTTP is not served anywhere."""

from __future__ import annotations

import ssl

import httpx
import pytest

from tests.support.e2e_helpers import cleanup, start_topology

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def topo(tmp_path_factory, request):
    t = start_topology(tmp_path_factory, prefill=1, decode=1, mode="prefill-first", tls=True)
    yield t
    cleanup(t, keep_logs=request.node.session.testsfailed > 0)


def test_every_hop_is_https_and_the_answer_is_unchanged(topo):
    assert all(c.url.startswith("https://") for c in topo.children)
    ctx = ssl.create_default_context(cafile=topo.ca_file)
    gateway, prefill = topo.gateway.url, topo.by_role("prefill")[0].url
    with httpx.Client(verify=ctx, timeout=120) as c:
        model = c.get(gateway + "/v1/models").json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": "The quick brown fox " * 12,
            "max_tokens": 8,
            "temperature": 0,
        }
        expected = c.post(prefill + "/v1/completions", json=body).json()["choices"][0]["text"]
        r = c.post(gateway + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        assert r.headers["x-pdpool-path"] != "decode"  # the prefill leg ran (over TLS)
    for child in topo.children:  # no plain-HTTP listener anywhere
        with pytest.raises(httpx.HTTPError):
            httpx.get(
                child.url.replace("https://", "http://") + "/health", timeout=3
            ).raise_for_status()
