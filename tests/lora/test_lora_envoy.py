"""Adapters behind real Envoy and `pdpool epp` (the GIE endpoint picker), and GIE's weighted
model rewrites (--model-rewrites, sidecar/routing/model_rewrite.py) in the picker and in our
gateway.

Two `pdpool serve` engines with --max-loras 1 behind their sidecars; Envoy asks the picker
where each request goes. An adapter is made resident on an engine by a long request sent to
that engine's sidecar directly. The picker's rewrite file sends `alpha` 75:25 to `alpha`
and `gamma`: each request's drawn target is what routing sees (it goes to the engine
running the target) and what the client gets back in `model` (GIE passes the model
server's answer through)."""

from __future__ import annotations

import collections
import os
import subprocess
import time

import httpx
import pytest
import yaml

from pdpool.ports import free_port
from pdpool.up.topology import SIDE_BY_SIDE, Topology, TopologySpec, healthy, pdpool_command
from tests.lora.test_lora_routing import BACKEND, body, sidecar_hostports, streaming, wait_running
from tests.support.e2e_helpers import metric
from tests.support.prerequisites import envoy_for_children

pytestmark = pytest.mark.slow

ROLLOUT = {"alpha": 75, "gamma": 25}
REQUESTS = 60


def rules_file(path) -> str:
    targets = [{"modelRewrite": m, "weight": w} for m, w in ROLLOUT.items()]
    rule = {"matches": [{"model": {"type": "Exact", "value": "alpha"}}], "targets": targets}
    path.write_text(yaml.safe_dump({"rules": [rule]}))
    return str(path)


@pytest.fixture(scope="module")
def topo(tiny_qwen3, qwen3_adapters, tmp_path_factory):
    envoy_for_children()
    logs = tmp_path_factory.mktemp("lora-envoy")
    lora = ["--enable-lora", "--max-loras=1", "--max-lora-rank=16"]
    lora += [f"--lora-modules={n}={p}" for n, p in qwen3_adapters.items()]
    spec = TopologySpec(
        model=str(tiny_qwen3),
        prefill=0,
        decode=2,
        mode="aggregated",
        log_dir=str(logs),
        engine_args=["--num-kv-blocks=512", *lora],
        gateway="envoy",
        epp_args=[
            "--lora-scrape-interval-s=0.1",
            f"--model-rewrites={rules_file(logs / 'rewrites.yaml')}",
        ],
        **SIDE_BY_SIDE,
    )
    t = Topology(spec)
    t.start(timeout_s=300)
    try:
        yield t
    finally:
        t.stop()


def complete(url: str, model: str, seed: int, n: int = 4) -> httpx.Response:
    r = httpx.post(f"{url}/v1/completions", json=body(model, n, seed), timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_each_adapter_goes_to_the_engine_holding_it_with_that_engines_tokens(topo):
    assert {"envoy", "epp"} <= {c.role for c in topo.children}
    sidecars, scs = sidecar_hostports(topo), topo.by_role("sidecar")
    engines = topo.by_role("decode")
    with streaming(scs[0].url, "beta", seed=300), streaming(scs[1].url, "gamma", seed=301):
        wait_running(topo, 0, "beta")
        wait_running(topo, 1, "gamma")
        for index, adapter in ((0, "beta"), (1, "gamma")):
            for seed in range(4):
                via = complete(topo.gateway.url, adapter, seed)
                assert via.headers[BACKEND] == sidecars[index], (adapter, seed)
                assert via.json()["model"] == adapter  # no rule for it: as sent
                direct = complete(engines[index].url, adapter, seed)
                assert via.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
    assert metric(topo.router.url, "pdpool_gateway_lora_routes_total", 'residency="running"') >= 8


def test_a_rollout_splits_by_weight_and_each_target_is_routed_by_its_residency(topo):
    sidecars, scs = sidecar_hostports(topo), topo.by_role("sidecar")
    engines = topo.by_role("decode")
    holder = {"alpha": 0, "gamma": 1}
    seen: collections.Counter[str] = collections.Counter()
    before = {
        m: metric(topo.router.url, "pdpool_model_rewrite_decisions_total", f'target_model="{m}"')
        for m in ROLLOUT
    }
    with streaming(scs[0].url, "alpha", seed=400), streaming(scs[1].url, "gamma", seed=401):
        wait_running(topo, 0, "alpha")
        wait_running(topo, 1, "gamma")
        direct = {m: complete(engines[i].url, m, 7).json() for m, i in holder.items()}
        for _ in range(REQUESTS):
            r = complete(topo.gateway.url, "alpha", 7)
            target = r.json()["model"]  # the client sees the drawn target, as in GIE
            assert target in ROLLOUT
            seen[target] += 1
            assert r.headers[BACKEND] == sidecars[holder[target]], target
            assert r.json()["choices"][0]["text"] == direct[target]["choices"][0]["text"]
    # 25% of 60: 15 expected, sd 3.35; [4, 28] is more than 3 sd either way.
    assert 4 <= seen["gamma"] <= 28 and seen["alpha"] + seen["gamma"] == REQUESTS, seen
    after = {
        m: metric(topo.router.url, "pdpool_model_rewrite_decisions_total", f'target_model="{m}"')
        for m in ROLLOUT
    }
    assert {m: after[m] - before[m] for m in ROLLOUT} == {m: float(seen[m]) for m in ROLLOUT}
    # The two adapters differ: the split is visible in the tokens too.
    assert direct["alpha"]["choices"][0]["text"] != direct["gamma"]["choices"][0]["text"]


def _gateway(tmp_path, topo, rules: str, extra=()) -> subprocess.Popen:
    port = free_port()
    urls = [f"--decode-url=http://{hp}" for hp in sidecar_hostports(topo)]
    argv = pdpool_command(
        "gateway", "--host=127.0.0.1", f"--port={port}", *urls, f"--model-rewrites={rules}", *extra
    )
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.port = port  # type: ignore[attr-defined]
    return proc


def test_our_gateway_applies_the_same_rules(topo, tmp_path):
    proc = _gateway(tmp_path, topo, rules_file(tmp_path / "rules.yaml"))
    url = f"http://127.0.0.1:{proc.port}"  # type: ignore[attr-defined]
    try:
        for _ in range(300):
            if healthy(url) or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert healthy(url), proc.communicate(timeout=5)
        models = collections.Counter(
            complete(url, "alpha", 9, n=1).json()["model"] for _ in range(40)
        )
        # 25% of 40: 10 expected, sd 2.7; [2, 20] is 3 sd either way.
        assert set(models) <= set(ROLLOUT) and 2 <= models["gamma"] <= 20, models
        assert complete(url, "beta", 9, n=1).json()["model"] == "beta"  # no rule for it
        unknown = tmp_path / "unknown.yaml"
        unknown.write_text(
            yaml.safe_dump(
                {
                    "rules": [
                        {
                            "matches": [{"model": {"value": "beta"}}],
                            "targets": [{"modelRewrite": "no-such-adapter"}],
                        }
                    ]
                }
            )
        )
        os.replace(unknown, tmp_path / "rules.yaml")  # reloaded: beta now goes nowhere real
        for _ in range(50):
            r = httpx.post(f"{url}/v1/completions", json=body("beta", 1, 9), timeout=30)
            if r.status_code != 200:
                break
            time.sleep(0.1)
        # An unknown target is the engine's 404, naming it (never another model's answer).
        assert r.status_code == 404 and "no-such-adapter" in r.text, r.text
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("command", ["gateway", "epp"])
def test_a_bad_rules_file_stops_the_router_with_one_line(tmp_path, command):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - targets: [{modelRewrite: a, weight: -3}]\n")
    args = [command, "--decode-url=http://127.0.0.1:9", f"--port={free_port()}"]
    args.append(f"--model-rewrites={bad}")
    if command == "epp":
        args += [f"--health-port={free_port()}", f"--metrics-port={free_port()}"]
    argv = pdpool_command(*args)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    lines = [x for x in out.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "rules[0].targets[0].weight" in lines[0], out.stderr
    assert "Traceback" not in out.stderr
