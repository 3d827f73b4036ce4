"""The sidecar's flows against stand-in vLLM engines (see vllm_standin.py: a labelled fake
of a third party) served on real sockets; the sidecar itself is the real one."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from pdpool.ports import free_port
from pdpool.sidecar.proxy.app import Sidecar
from pdpool.sidecar.proxy.settings import SidecarSettings

from tests.support.vllm_standin import VllmStandIn, greedy_output

HISTORY = " ".join(f"h{i}" for i in range(40))


async def topology(servers, n_prefill=1, **settings):
    decode = VllmStandIn("decode-0")
    dec = await servers(decode)
    decode.state.port = dec.port
    prefills = []
    for i in range(n_prefill):
        p = VllmStandIn(f"prefill-{i}")
        s = await servers(p)
        p.state.port = s.port
        prefills.append((p, s))
    cfg = SidecarSettings(
        decode_url=dec.url,
        prefill_urls=[s.host_port for _, s in prefills],
        **{"cache_hit_threshold": 0.5, "decode_retry_s": 0.5, **settings},
    )
    sidecar = Sidecar(cfg)
    side = await servers(sidecar)
    return decode, [p for p, _ in prefills], sidecar, side


def expected_text(words, n):
    return " ".join(greedy_output(words, n))


async def test_warm_prompt_is_served_by_decode_alone(servers):
    decode, (prefill,), _sidecar, side = await topology(servers)
    prompt = HISTORY
    decode.state.store(prompt.split())
    async with httpx.AsyncClient() as c:
        r = await c.post(side.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5})
    assert r.status_code == 200
    assert r.headers["x-pdpool-path"] == "decode"
    assert r.json()["choices"][0]["text"] == expected_text(prompt.split(), 5)
    assert prefill.state.received == []
    assert [b["cache_hit_threshold"] for _, b, _ in decode.state.received] == [0.5]


@pytest.mark.parametrize("stream", [False, True])
async def test_cold_prompt_is_rejected_prefilled_remotely_and_decoded(servers, stream):
    decode, (prefill,), _sidecar, side = await topology(servers)
    body = (
        {
            "prompt": HISTORY,
            "max_tokens": 6,
            "min_tokens": 3,
            "stream": stream,
            "stream_options": {"include_usage": True},
        }
        if stream
        else {"prompt": HISTORY, "max_tokens": 6, "min_tokens": 3}
    )
    async with httpx.AsyncClient() as c:
        r = await c.post(
            side.url + "/v1/completions", json=body, headers={"x-request-id": "req-abc"}
        )
    assert r.status_code == 200 and r.headers["x-pdpool-path"] == "pd"
    assert r.headers["x-request-id"] == "req-abc"
    # legs: decode-first (rejected), prefill, decode with the prefill's params verbatim
    assert len(decode.state.received) == 2 and len(prefill.state.received) == 1
    _, pleg, pheaders = prefill.state.received[0]
    assert pleg["stream"] is False and pleg["max_tokens"] == 1 and pleg["min_tokens"] == 1
    assert "stream_options" not in pleg
    assert pleg["kv_transfer_params"]["do_remote_decode"] is True
    _, dleg, dheaders = decode.state.received[1]
    assert dleg["kv_transfer_params"]["remote_engine_id"] == "prefill-0"
    assert dleg["kv_transfer_params"]["remote_request_id"] == "req-abc"
    assert dleg["cache_hit_threshold"] == 0.0 and dleg["max_tokens"] == 6
    assert dleg.get("stream", False) is stream and dleg["min_tokens"] == 3
    assert pheaders["x-request-id"] == dheaders["x-request-id"] == "req-abc"
    words = HISTORY.split()
    if stream:
        events = [
            json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")
        ]
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        usage = [e["usage"] for e in events if e.get("usage")][-1]
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        text = r.json()["choices"][0]["text"]
        usage = r.json()["usage"]
    assert text == expected_text(words, 6)
    # prefill computed all 40 tokens, decode pulled all but 1 and computed 1
    assert usage["prompt_tokens"] == 40
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


async def test_streamed_chat_is_rejected_after_role_chunk_and_completed(servers):
    _decode, (_prefill,), _sidecar, side = await topology(servers)
    messages = [{"role": "user", "content": HISTORY}]
    async with httpx.AsyncClient() as c:
        r = await c.post(
            side.url + "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 4, "stream": True},
        )
        direct = await c.post(
            side.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4}
        )
    assert r.headers["x-pdpool-path"] == "pd"
    assert "cache_threshold" not in r.text
    deltas = [
        json.loads(x[6:])["choices"][0]["delta"].get("content") or ""
        for x in r.text.split("\n\n")
        if x.startswith("data: {")
    ]
    assert "".join(deltas) == direct.json()["choices"][0]["message"]["content"]
    assert direct.headers["x-pdpool-path"] == "decode"  # now warm on decode


async def test_turn_with_long_new_message_pulls_history_from_decode(servers):
    decode, (prefill,), _sidecar, side = await topology(servers, cache_hit_threshold=0.8)
    decode.state.store(HISTORY.split())
    long_turn = HISTORY + " " + " ".join(f"n{i}" for i in range(40))
    async with httpx.AsyncClient() as c:
        r = await c.post(side.url + "/v1/completions", json={"prompt": long_turn, "max_tokens": 3})
        short = await c.post(
            side.url + "/v1/completions", json={"prompt": long_turn + " ok", "max_tokens": 3}
        )
        metrics = (await c.get(side.url + "/metrics")).text
    assert r.headers["x-pdpool-path"] == "pd"
    pkv = prefill.state.received[0][1]["kv_transfer_params"]
    assert pkv["remote_engine_id"] == "decode-0" and pkv["remote_num_tokens"] == 40
    assert prefill.state.pulled_tokens == 40 and prefill.state.computed_tokens == 40
    # short follow-up: decode alone, no new prefill leg
    assert short.headers["x-pdpool-path"] == "decode" and len(prefill.state.received) == 1
    assert 'pdpool_sidecar_requests_total{mode="decode-first",path="pd"} 1.0' in metrics
    assert 'pdpool_sidecar_requests_total{mode="decode-first",path="decode"} 1.0' in metrics
    assert "pdpool_sidecar_pull_offered_tokens_total 40.0" in metrics


async def test_no_pull_when_disabled(servers):
    decode, (prefill,), _sidecar, side = await topology(
        servers, pull_from_decode=False, cache_hit_threshold=0.8
    )
    decode.state.store(HISTORY.split())
    async with httpx.AsyncClient() as c:
        r = await c.post(
            side.url + "/v1/completions", json={"prompt": HISTORY + " " + HISTORY, "max_tokens": 2}
        )
    assert r.headers["x-pdpool-path"] == "pd"
    assert "remote_num_tokens" not in prefill.state.received[0][1]["kv_transfer_params"]


async def test_prefill_down_retries_next_then_falls_back_to_decode(servers):
    decode, (p0, p1), _sidecar, side = await topology(servers, n_prefill=2)
    p0.state.fail_status = 500
    async with httpx.AsyncClient() as c:
        results = [
            await c.post(
                side.url + "/v1/completions", json={"prompt": f"q{i} {HISTORY}", "max_tokens": 2}
            )
            for i in range(4)
        ]
        assert all(r.headers["x-pdpool-path"] == "pd" for r in results)
        assert all(
            r.headers["x-pdpool-prefill-endpoint"] == f"127.0.0.1:{p1.state.port}" for r in results
        )
        p1.state.fail_status = 503
        r = await c.post(
            side.url + "/v1/completions", json={"prompt": "last " + HISTORY, "max_tokens": 2}
        )
        metrics = (await c.get(side.url + "/metrics")).text
    assert r.status_code == 200 and r.headers["x-pdpool-path"] == "fallback"
    assert r.json()["choices"][0]["text"] == expected_text(("last " + HISTORY).split(), 2)
    assert decode.state.received[-1][1]["cache_hit_threshold"] == 0.0
    assert "kv_transfer_params" not in decode.state.received[-1][1]
    assert 'path="fallback"} 1.0' in metrics
    assert 'pdpool_sidecar_prefill_attempts_total{outcome="server_error"}' in metrics


async def test_unreachable_and_hanging_prefill_fall_back_in_bounded_time(servers):
    dead = f"127.0.0.1:{free_port()}"
    _decode, (hanging,), sidecar, side = await topology(servers, prefill_timeout=0.5)
    sidecar.endpoints._static.insert(0, dead)
    hanging.state.hang = True
    started = time.monotonic()
    async with httpx.AsyncClient() as c:
        r = await c.post(side.url + "/v1/completions", json={"prompt": HISTORY, "max_tokens": 2})
        metrics = (await c.get(side.url + "/metrics")).text
    assert r.status_code == 200 and r.headers["x-pdpool-path"] == "fallback"
    assert time.monotonic() - started < 5
    assert 'outcome="timeout"} 1.0' in metrics and 'outcome="connect_error"} 1.0' in metrics


async def test_prefiller_header_must_name_a_known_prefill_engine(servers):
    decode, (p0, p1), _sidecar, side = await topology(servers, n_prefill=2)
    async with httpx.AsyncClient() as c:
        bad = await c.post(
            side.url + "/v1/completions",
            json={"prompt": HISTORY, "max_tokens": 2},
            headers={"x-prefiller-host-port": "169.254.169.254:80"},
        )
        to_decode = await c.post(
            side.url + "/v1/completions",
            json={"prompt": HISTORY, "max_tokens": 2},
            headers={"x-prefiller-host-port": side.host_port},
        )
        good = await c.post(
            side.url + "/v1/completions",
            json={"prompt": HISTORY, "max_tokens": 2},
            headers={"x-prefiller-host-port": f"127.0.0.1:{p1.state.port}"},
        )
    for r in (bad, to_decode):
        assert r.status_code == 403
        assert r.json()["error"]["type"] == "permission_error"
        assert r.json()["error"]["param"] == "x-prefiller-host-port"
    assert decode.state.received[0][1]["prompt"] == HISTORY and len(decode.state.received) == 2
    assert good.status_code == 200 and len(p1.state.received) == 1 and not p0.state.received
    assert "x-prefiller-host-port" not in p1.state.received[0][2]


async def test_prefiller_header_list_as_llm_d(servers):
    """llm-d's comma-separated list (or repeated header lines): every entry must be allowed."""
    _decode, (p0, p1), _sidecar, side = await topology(servers, n_prefill=2)
    ok1, ok0 = f"127.0.0.1:{p1.state.port}", f"127.0.0.1:{p0.state.port}"
    body = {"prompt": HISTORY, "max_tokens": 2}
    async with httpx.AsyncClient() as c:
        mixed = await c.post(
            side.url + "/v1/completions",
            json=body,
            headers={"x-prefiller-host-port": f"{ok1}, {side.host_port}"},
        )
        repeated = await c.post(
            side.url + "/v1/completions",
            json=body,
            headers=[
                ("x-prefiller-host-port", ok1),
                ("x-prefiller-host-port", "169.254.169.254:80"),
            ],
        )
        empty_entry = await c.post(
            side.url + "/v1/completions", json=body, headers={"x-prefiller-host-port": f"{ok1},,"}
        )
        assert not p0.state.received and not p1.state.received
        good = await c.post(
            side.url + "/v1/completions",
            json=body,
            headers={"x-prefiller-host-port": f"{ok1} ,{ok1}"},
        )
        other = {"prompt": " ".join(f"o{i}" for i in range(40)), "max_tokens": 2}
        both = await c.post(
            side.url + "/v1/completions",
            json=other,
            headers=[("x-prefiller-host-port", ok0), ("x-prefiller-host-port", ok1)],
        )
    for r in (mixed, repeated, empty_entry):
        assert r.status_code == 403 and r.json()["error"]["param"] == "x-prefiller-host-port"
    assert good.status_code == 200 and good.headers["x-pdpool-prefill-endpoint"] == ok1
    assert both.status_code == 200
    assert both.headers["x-pdpool-prefill-endpoint"] in (ok0, ok1)
    assert len(p0.state.received) + len(p1.state.received) == 2


async def test_client_kv_transfer_params_never_reach_an_engine(servers):
    decode, (prefill,), _sidecar, side = await topology(servers)
    evil = {
        "do_remote_prefill": True,
        "remote_engine_id": "x",
        "remote_host": "10.9.9.9",
        "remote_port": 1,
        "remote_block_ids": [0, 1, 2],
    }
    async with httpx.AsyncClient() as c:
        r = await c.post(
            side.url + "/v1/completions",
            json={"prompt": HISTORY, "max_tokens": 2, "kv_transfer_params": evil},
        )
    assert r.status_code == 200
    for _, body, _ in decode.state.received + prefill.state.received:
        assert body.get("kv_transfer_params", {}).get("remote_host") != "10.9.9.9"
    assert decode.state.received[0][1].get("kv_transfer_params") is None


@pytest.mark.parametrize(
    "content,status",
    [
        (b"{not json", 400),
        (b"", 400),
        (b"[1,2]", 400),
        (b"\xff\xfe", 400),
        (b'{"prompt": "x", "stream": "yes"}', 400),
        (b'{"prompt": "x", "cache_hit_threshold": 7}', 400),
        (b'{"prompt": "x", "max_tokens": "many"}', 400),
        (b"[" * 100000, 400),
    ],
)
async def test_malformed_bodies_get_openai_400s(servers, content, status):
    decode, _, _sidecar, side = await topology(servers)
    async with httpx.AsyncClient() as c:
        r = await c.post(
            side.url + "/v1/chat/completions",
            content=content,
            headers={"content-type": "application/json"},
        )
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert decode.state.received == []


async def test_engine_4xx_passes_through(servers):
    decode, _, _sidecar, side = await topology(servers)
    decode.state.fail_status = 422
    async with httpx.AsyncClient() as c:
        r = await c.post(side.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 422 and r.json()["error"]["message"] == "boom"


async def test_client_disconnect_mid_stream_cancels_decode(servers):
    decode, _, _sidecar, side = await topology(servers)
    decode.state.store(HISTORY.split())
    decode.state.token_delay_s = 0.05
    async with (
        httpx.AsyncClient() as c,
        c.stream(
            "POST",
            side.url + "/v1/completions",
            json={"prompt": HISTORY, "max_tokens": 200, "stream": True},
        ) as r,
    ):
        async for _ in r.aiter_raw():
            break  # first chunk, then hang up
    for _ in range(100):
        if decode.state.cancelled:
            break
        await asyncio.sleep(0.02)
    assert decode.state.cancelled == 1


async def test_client_disconnect_during_prefill_cancels_prefill(servers):
    decode, (prefill,), sidecar, side = await topology(servers, prefill_timeout=30)
    prefill.state.hang = True
    async with httpx.AsyncClient() as c:
        task = asyncio.create_task(
            c.post(side.url + "/v1/completions", json={"prompt": HISTORY, "max_tokens": 2})
        )
        for _ in range(100):
            if prefill.state.received:
                break
            await asyncio.sleep(0.02)
        task.cancel()
    for _ in range(100):
        if sidecar.picker.in_flight(sidecar.endpoints.current[0]) == 0:
            break
        await asyncio.sleep(0.02)
    assert sidecar.picker.in_flight(sidecar.endpoints.current[0]) == 0
    assert len(decode.state.received) == 1  # no decode leg after the client left
    for _ in range(100):
        if prefill.state.cancelled:
            break
        await asyncio.sleep(0.02)
    assert prefill.state.cancelled == 1
    metrics = (await httpx.AsyncClient().get(side.url + "/metrics")).text
    assert 'path="cancelled"} 1.0' in metrics


async def test_decode_down_is_503_and_a_restarted_decode_is_retried(servers):
    port = free_port()
    cfg = SidecarSettings(decode_url=f"http://127.0.0.1:{port}", decode_retry_s=0.3)
    side = await servers(Sidecar(cfg))
    async with httpx.AsyncClient() as c:
        r = await c.post(side.url + "/v1/completions", json={"prompt": "a b", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "decode_unavailable"
        health = await c.get(side.url + "/health")
        assert health.status_code == 503
        # the engine comes back while the request is being retried
        side.app.settings.decode_retry_s = 5.0
        pending = asyncio.create_task(
            c.post(
                side.url + "/v1/completions",
                json={"prompt": "a b", "max_tokens": 1, "cache_hit_threshold": 0},
            )
        )
        await asyncio.sleep(0.4)
        decode = VllmStandIn("decode-0")
        await servers(decode, port=port)
        r = await pending
    assert r.status_code == 200 and len(decode.state.received) == 1


@pytest.mark.parametrize("mode", ["prefill-first", "aggregated"])
async def test_other_modes(servers, mode):
    decode, (prefill,), _sidecar, side = await topology(servers, mode=mode)
    decode.state.store(HISTORY.split())
    async with httpx.AsyncClient() as c:
        r = await c.post(
            side.url + "/v1/completions",
            json={"prompt": HISTORY, "max_tokens": 3, "cache_hit_threshold": 0.9},
        )
        models = await c.get(side.url + "/v1/models")
    assert r.json()["choices"][0]["text"] == expected_text(HISTORY.split(), 3)
    assert models.json()["data"][0]["id"] == "standin"
    if mode == "aggregated":
        assert r.headers["x-pdpool-path"] == "aggregated" and not prefill.state.received
        assert decode.state.received[0][1]["cache_hit_threshold"] == 0.0
    else:
        assert r.headers["x-pdpool-path"] == "pd" and len(prefill.state.received) == 1
        assert len(decode.state.received) == 1


async def test_decode_dying_before_the_first_token_is_retried(servers):
    decode, _, _sidecar, side = await topology(servers)
    decode.state.store(HISTORY.split())
    decode.state.drop_streams = 2
    async with httpx.AsyncClient() as c:
        r = await c.post(
            side.url + "/v1/completions", json={"prompt": HISTORY, "max_tokens": 3, "stream": True}
        )
        metrics = (await c.get(side.url + "/metrics")).text
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert len(decode.state.received) == 3
    assert "pdpool_sidecar_decode_retries_total 2.0" in metrics


async def test_decode_dying_for_good_is_an_openai_503(servers):
    decode, _, _sidecar, side = await topology(servers, decode_retry_s=0.3)
    decode.state.store(HISTORY.split())
    decode.state.drop_streams = 1000
    async with httpx.AsyncClient() as c:
        r = await c.post(
            side.url + "/v1/completions", json={"prompt": HISTORY, "max_tokens": 3, "stream": True}
        )
    assert r.status_code == 503 and r.json()["error"]["code"] == "decode_unavailable"


@pytest.mark.parametrize("warm", [True, False], ids=["accepted", "rejected"])
async def test_a_stream_that_arrives_in_one_read_reaches_the_client_whole(servers, warm):
    """Decode's whole answer in one network read: the events after the one that decides
    decode-first are relayed too (an accepted stream), or searched for kv params (a
    rejected one)."""
    decode, (prefill,), _sidecar, side = await topology(servers)
    decode.state.coalesce = True
    words = HISTORY.split()
    if warm:
        decode.state.store(words)
    async with httpx.AsyncClient() as c:
        r = await c.post(
            side.url + "/v1/completions", json={"prompt": HISTORY, "max_tokens": 6, "stream": True}
        )
    assert r.status_code == 200 and r.headers["x-pdpool-path"] == ("decode" if warm else "pd")
    events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected_text(
        words, 6
    )
    assert r.text.rstrip().endswith("data: [DONE]")
    assert len(prefill.state.received) == (0 if warm else 1)


@pytest.mark.parametrize("mode", ["decode-first", "prefill-first"])
async def test_a_batch_of_prompts_is_served_where_it_lands(servers, mode):
    """One request's KV handoff carries one prompt: a batch never becomes P/D legs (a real
    engine refuses kv_transfer_params with several prompts)."""
    decode, (prefill,), _sidecar, side = await topology(servers, mode=mode)
    async with httpx.AsyncClient() as c:
        r = await c.post(
            side.url + "/v1/completions",
            json={"prompt": [HISTORY, "a b c"], "max_tokens": 2, "cache_hit_threshold": 0.9},
        )
    assert r.status_code == 200, r.text
    assert r.headers["x-pdpool-path"] == "aggregated" and not prefill.state.received
    sent = decode.state.received[0][1]
    assert sent["cache_hit_threshold"] == 0.0 and "kv_transfer_params" not in sent


async def test_a_header_with_latin_1_octets_passes_through(servers):
    """Headers are octets: one outside ASCII is forwarded as it came on every leg (a pass-
    through route, a prefill leg, a decode leg), not a 500."""
    _decode, (prefill,), _sidecar, side = await topology(servers)
    note = [(b"x-note", "café".encode("latin-1"))]
    async with httpx.AsyncClient() as c:
        r = await c.get(side.url + "/v1/models", headers=note)
        cold = await c.post(
            side.url + "/v1/completions", json={"prompt": HISTORY, "max_tokens": 2}, headers=note
        )
    assert r.status_code == 200, r.text
    assert cold.status_code == 200 and cold.headers["x-pdpool-path"] == "pd", cold.text
    assert len(prefill.state.received) == 1
