"""Decode-first with an engine that cannot reject (stock vLLM ignores cache_hit_threshold):
the sidecar knows it (setting, or a probe) and decides P/D by prompt length itself, instead
of silently never disaggregating. Against the vLLM stand-in (vllm_standin.py, a labelled fake)
with its threshold support switched off; the sidecar is the real one."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdpool.sidecar.routing.pd import estimate_prompt_tokens
from pdpool.sidecar.proxy.app import Sidecar
from pdpool.sidecar.proxy.settings import SidecarSettings

from tests.support.vllm_standin import VllmStandIn

LONG = " ".join(f"w{i}" for i in range(200))  # ~200 words: > 128 estimated tokens
SHORT = "w1 w2 w3"


def test_estimate_prompt_tokens():
    assert estimate_prompt_tokens({"prompt": "x" * 400}) == 100
    assert estimate_prompt_tokens({"prompt": "x" * 401}) == 101
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3
    assert estimate_prompt_tokens({"prompt": ["x" * 8, [1] * 5]}) == 5
    assert (
        estimate_prompt_tokens(
            {
                "messages": [
                    {"role": "system", "content": "x" * 40},
                    {"role": "user", "content": [{"type": "text", "text": "y" * 40}]},
                ]
            }
        )
        == 20
    )
    assert estimate_prompt_tokens({}) == 0


def test_settings_validate():
    with pytest.raises(ValueError):
        SidecarSettings(engine_rejects="maybe").validate()
    with pytest.raises(ValueError):
        SidecarSettings(prefill_min_prompt_tokens=-1).validate()


async def _topology(servers, honours: bool, **settings):
    decode = VllmStandIn("decode-0")
    decode.state.honours_threshold = honours
    dec = await servers(decode)
    prefill = VllmStandIn("prefill-0")
    prefill.state.honours_threshold = honours
    pre = await servers(prefill)
    prefill.state.port = pre.port
    cfg = SidecarSettings(
        decode_url=dec.url, prefill_urls=[pre.host_port], **{"cache_hit_threshold": 0.5, **settings}
    )
    sidecar = Sidecar(cfg)
    side = await servers(sidecar)
    return decode, prefill, sidecar, side


async def _wait_known(sidecar, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while sidecar.capability.known is None:
        assert asyncio.get_running_loop().time() < deadline, "probe never answered"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("setting", ["auto", "no"])
@pytest.mark.parametrize("stream", [False, True])
async def test_engine_that_cannot_reject_is_disaggregated_by_length(servers, setting, stream):
    decode, prefill, sidecar, side = await _topology(servers, honours=False, engine_rejects=setting)
    await _wait_known(sidecar)
    assert sidecar.capability.known is False
    async with httpx.AsyncClient() as c:
        paths = []
        for prompt in (LONG, SHORT):
            r = await c.post(
                side.url + "/v1/completions",
                json={"prompt": prompt, "max_tokens": 3, "stream": stream},
            )
            assert r.status_code == 200
            paths.append(r.headers["x-pdpool-path"])
        metrics = (await c.get(side.url + "/metrics")).text
    assert paths == ["pd", "decode"]
    # the long prompt: one prefill leg, then one decode leg with its kv params
    assert len(prefill.state.received) == 1
    assert prefill.state.received[0][1]["prompt"] == LONG
    legs = [(b["prompt"], bool(b.get("kv_transfer_params"))) for _, b, _ in decode.state.received]
    assert legs == [(LONG, True), (SHORT, False)]
    assert "pdpool_sidecar_engine_rejects 0.0" in metrics
    assert 'pdpool_sidecar_length_decisions_total{decision="pd"} 1.0' in metrics
    assert 'pdpool_sidecar_length_decisions_total{decision="decode"} 1.0' in metrics
    assert decode.state.probes == (1 if setting == "auto" else 0)


async def test_length_is_configurable(servers):
    _decode, prefill, _sidecar, side = await _topology(
        servers, honours=False, engine_rejects="no", prefill_min_prompt_tokens=1
    )
    async with httpx.AsyncClient() as c:
        r = await c.post(side.url + "/v1/completions", json={"prompt": SHORT, "max_tokens": 2})
    assert r.headers["x-pdpool-path"] == "pd" and len(prefill.state.received) == 1


async def test_engine_that_rejects_is_probed_and_keeps_decode_first(servers):
    decode, _prefill, sidecar, side = await _topology(servers, honours=True)
    await _wait_known(sidecar)
    assert sidecar.capability.known is True and decode.state.probes == 1
    async with httpx.AsyncClient() as c:
        r = await c.post(side.url + "/v1/completions", json={"prompt": SHORT, "max_tokens": 2})
        metrics = (await c.get(side.url + "/metrics")).text
    # a short cold prompt is still rejected by decode and prefilled remotely: decode-first
    assert r.headers["x-pdpool-path"] == "pd"
    assert decode.state.received[0][1]["cache_hit_threshold"] == 0.5
    assert "pdpool_sidecar_engine_rejects 1.0" in metrics
