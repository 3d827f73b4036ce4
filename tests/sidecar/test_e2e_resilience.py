"""Sick engines on the real topology (`pdpool up --prefill 2 --decode 2` as processes):
a decode engine killed or frozen mid-stream (the stream goes on elsewhere, exactly), a
frozen prefill engine ejected within seconds, and a client that disconnects aborting its
request in both engines."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.support.e2e_helpers import cleanup, metric, model_name, start_topology

pytestmark = pytest.mark.slow

N_TOKENS = 400


@pytest.fixture(scope="module")
def topo(request, tmp_path_factory):
    t = start_topology(
        tmp_path_factory, prefill=2, decode=2, cache_hit_threshold=0.5, decode_retry_s=30.0
    )
    yield t
    cleanup(t, keep_logs=request.node.session.testsfailed > 0)


@pytest.fixture(scope="module")
def model(topo):
    return model_name(topo.gateway.url)


def reference(topo, route: str, body: dict) -> dict:
    """The uninterrupted greedy answer of one engine on its own."""
    url = topo.by_role("prefill")[0].url
    r = httpx.post(url + route, json={**body, "stream": False}, timeout=120)
    r.raise_for_status()
    return r.json()


def serving_decode(topo, response, role="decode"):
    """The decode engine (or sidecar) behind the sidecar that answered."""
    port = int(response.headers["x-pdpool-backend"].rsplit(":", 1)[1])
    sidecars = topo.by_role("sidecar")
    return topo.by_role(role)[[s.port for s in sidecars].index(port)]


def stream_with_fault(topo, route: str, body: dict, fault, role="decode") -> tuple[str, dict, int]:
    """Streams through the gateway; after a few text chunks calls fault(decode engine)
    once. Returns the text, the usage and how many chunks arrived."""
    text, usage, chunks, faulted = [], None, 0, False
    t0 = time.monotonic()
    with httpx.stream("POST", topo.gateway.url + route, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            assert "error" not in data, data
            chunks += 1
            if data.get("usage"):
                usage = data["usage"]
            for choice in data.get("choices") or []:
                assert "token_ids" not in choice  # the gateway's own extension stays inside
                piece = (
                    choice.get("text")
                    if "text" in choice
                    else (choice.get("delta") or {}).get("content")
                )
                text.append(piece or "")
            if not faulted and "".join(text):
                fault(serving_decode(topo, r, role))
                faulted = True
    assert faulted
    print(f"\n{route}: {chunks} chunks in {time.monotonic() - t0:.2f}s")
    return "".join(text), usage, chunks


def test_stream_survives_its_decode_engine_or_sidecar_being_killed(topo, model):
    body = {
        "model": model,
        "prompt": "The history of the lighthouse keeper " * 6,
        "max_tokens": N_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    ref = reference(topo, "/v1/completions", body)
    killed = []

    def kill(decode):
        os.kill(decode.pid, signal.SIGKILL)
        killed.append(decode)

    text, usage, _ = stream_with_fault(
        topo,
        "/v1/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
        kill,
    )
    try:
        assert text == ref["choices"][0]["text"]
        assert usage["completion_tokens"] == N_TOKENS
        assert usage["prompt_tokens"] == ref["usage"]["prompt_tokens"]
        assert metric(topo.gateway.url, "pdpool_gateway_migrations_total", 'outcome="ok"') >= 1
    finally:
        killed[0].proc.wait(10)
        topo.restart(killed[0])

    # A chat stream whose sidecar dies: continued as a completion of the rendered chat,
    # sent back as chat.
    messages = [
        {"role": "system", "content": "You answer at length. " * 4},
        {"role": "user", "content": "Tell me about harbors. " * 4},
    ]
    chat = {
        "model": model,
        "messages": messages,
        "max_tokens": N_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    ref = reference(topo, "/v1/chat/completions", chat)
    topo.wait_healthy(120)
    text, usage, _ = stream_with_fault(
        topo,
        "/v1/chat/completions",
        {**chat, "stream": True, "stream_options": {"include_usage": True}},
        kill,
        "sidecar",
    )
    try:
        assert text == ref["choices"][0]["message"]["content"]
        assert usage["completion_tokens"] == N_TOKENS
        assert usage["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    finally:
        killed[1].proc.wait(10)
        topo.restart(killed[1])
        topo.wait_healthy(120)


def test_guided_stream_survives_its_decode_engine_being_killed(topo, model):
    """A JSON-schema stream migrated mid-way goes on under its grammar, advanced over the
    tokens already sent: the client gets the uninterrupted greedy answer, valid JSON."""
    import jsonschema

    schema = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 999},
        "minItems": 120,
        "maxItems": 120,
    }
    body = {
        "model": model,
        "prompt": "Numbers of the lighthouse keeper " * 6,
        "max_tokens": 700,
        "temperature": 0,
        "structured_outputs": {"json": schema, "disable_any_whitespace": True},
    }
    ref = reference(topo, "/v1/completions", body)
    killed = []

    def kill(decode):
        os.kill(decode.pid, signal.SIGKILL)
        killed.append(decode)

    topo.wait_healthy(120)
    before = metric(topo.gateway.url, "pdpool_gateway_migrations_total", 'outcome="ok"')
    text, _, _ = stream_with_fault(topo, "/v1/completions", {**body, "stream": True}, kill)
    try:
        assert metric(topo.gateway.url, "pdpool_gateway_migrations_total", 'outcome="ok"') > before
        assert text == ref["choices"][0]["text"]
        jsonschema.validate(json.loads(text), schema)
    finally:
        killed[0].proc.wait(10)
        topo.restart(killed[0])
        topo.wait_healthy(120)


def wait_for(predicate, timeout_s: float) -> float:
    """Seconds until predicate() held; fails after timeout_s."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"not within {timeout_s}s")
        time.sleep(0.1)
    return time.monotonic() - t0


def test_frozen_prefill_engine_is_ejected_within_seconds(topo, model):
    p0, _p1 = topo.by_role("prefill")
    sidecars = topo.by_role("sidecar")
    label = f'endpoint="127.0.0.1:{p0.port}"'
    results = []

    def cold(tag):
        t = time.monotonic()
        r = httpx.post(
            topo.gateway.url + "/v1/completions",
            timeout=60,
            json={"model": model, "prompt": f"{tag}: never seen before " * 12, "max_tokens": 2},
            headers={"x-prefiller-host-port": f"127.0.0.1:{p0.port}"},
        )
        results.append((r.status_code, time.monotonic() - t))

    os.kill(p0.pid, signal.SIGSTOP)
    try:
        # A request sent to the frozen engine right away is given up on at the ejection.
        caught = threading.Thread(target=cold, args=("caught",))
        caught.start()
        took = wait_for(
            lambda: all(
                metric(s.url, "pdpool_sidecar_prefill_ejected", label) == 1 for s in sidecars
            ),
            10,
        )
        print(f"\nfrozen prefill engine ejected by every sidecar after {took:.2f}s")
        caught.join(30)
        t = time.monotonic()
        r = httpx.post(
            topo.gateway.url + "/v1/completions",
            timeout=60,
            json={"model": model, "prompt": "after ejection " * 12, "max_tokens": 2},
        )
        follow_up = time.monotonic() - t
        print(f"request caught on it: {results[0][1]:.2f}s; follow-up: {follow_up:.2f}s")
        assert results[0][0] == 200 and results[0][1] < 15
        assert r.status_code == 200 and follow_up < 5
        assert r.headers["x-pdpool-prefill-endpoint"] != f"127.0.0.1:{p0.port}"
    finally:
        os.kill(p0.pid, signal.SIGCONT)
    back = wait_for(
        lambda: all(metric(s.url, "pdpool_sidecar_prefill_ejected", label) == 0 for s in sidecars),
        15,
    )
    print(f"readmitted {back:.2f}s after SIGCONT")
    assert metric(sidecars[0].url, "pdpool_sidecar_prefill_ejections_total", label) >= 1


def test_frozen_decode_engine_is_ejected_and_its_stream_moves_on(topo, model):
    body = {
        "model": model,
        "prompt": "A long letter about the sea " * 6,
        "max_tokens": N_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    ref = reference(topo, "/v1/completions", body)
    frozen, t_freeze = [], []

    def freeze(decode):
        os.kill(decode.pid, signal.SIGSTOP)
        frozen.append(decode)
        t_freeze.append(time.monotonic())

    try:
        text, _usage, _ = stream_with_fault(
            topo, "/v1/completions", {**body, "stream": True}, freeze
        )
        print(
            f"\nstream on a frozen decode engine finished "
            f"{time.monotonic() - t_freeze[0]:.2f}s after the freeze"
        )
        assert text == ref["choices"][0]["text"]
        assert metric(topo.gateway.url, "pdpool_gateway_ejections_total") >= 1
        sidecar = topo.by_role("sidecar")[topo.by_role("decode").index(frozen[0])]
        assert (
            metric(
                topo.gateway.url,
                "pdpool_gateway_backend_ejected",
                f'backend="127.0.0.1:{sidecar.port}"',
            )
            == 1
        )
        t = time.monotonic()
        r = httpx.post(
            topo.gateway.url + "/v1/completions",
            timeout=60,
            json={"model": model, "prompt": "while frozen " * 12, "max_tokens": 2},
        )
        assert r.status_code == 200 and time.monotonic() - t < 5
    finally:
        for d in frozen:
            os.kill(d.pid, signal.SIGCONT)


def test_client_disconnect_aborts_both_legs(topo, model):
    """A P/D stream (cold prompt: prefill leg, then decode leg) dropped by its client
    leaves no request running or waiting in any engine."""
    engines = topo.by_role("prefill") + topo.by_role("decode")
    decodes = topo.by_role("decode")

    def decode_counts():
        return (
            sum(metric(d.url, "pdpool_requests_aborted_total") for d in decodes),
            sum(
                metric(d.url, "pdpool_request_success_total", 'finished_reason="length"')
                for d in decodes
            ),
        )

    def idle():
        return all(
            metric(e.url, "pdpool_num_requests_running") == 0
            and metric(e.url, "pdpool_num_requests_waiting") == 0
            for e in engines
        )

    # An earlier test's request may still be ending (an engine just thawed): not this one's.
    wait_for(idle, 10)
    aborted, finished = decode_counts()
    with httpx.stream(
        "POST",
        topo.gateway.url + "/v1/completions",
        timeout=60,
        json={
            "model": model,
            "prompt": "cancel me, a cold prompt " * 20,
            "max_tokens": 1700,
            "ignore_eos": True,
            "stream": True,
        },
    ) as r:
        assert r.status_code == 200
        assert r.headers["x-pdpool-path"] == "pd"
        for _ in r.iter_raw():
            break

    print(f"\nall engines idle {wait_for(idle, 10):.2f}s after the disconnect")
    aborted_now, finished_now = decode_counts()
    assert (aborted_now - aborted, finished_now - finished) == (1, 0)
    assert (
        metric(topo.by_role("sidecar")[0].url, "pdpool_sidecar_requests_total", 'path="cancelled"')
        + metric(
            topo.by_role("sidecar")[1].url, "pdpool_sidecar_requests_total", 'path="cancelled"'
        )
        >= 1
    )


def test_client_disconnect_while_the_prefill_leg_waits_aborts_it(tmp_path_factory):
    """A prefill engine that serves one request at a time is busy; a P/D request's prefill
    leg waits in its queue; the client gives up: the queued request is aborted at once
    (not computed when the engine frees up) and no decode leg follows."""
    from pdpool.up.topology import SIDE_BY_SIDE, Topology, TopologySpec, ensure_tiny_model

    log_dir = str(tmp_path_factory.mktemp("up-cancel"))
    # The tiny model with room for a long busy request: 19000 decode steps keep the engine
    # busy for tens of seconds (4000, its own limit, could end before the leg was queued).
    model_dir = tmp_path_factory.mktemp("long-tiny")
    shutil.copytree(ensure_tiny_model("qwen3"), model_dir, dirs_exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = 20480
    (model_dir / "config.json").write_text(json.dumps(config))
    topo = Topology(
        TopologySpec(
            model=str(model_dir),
            prefill=1,
            decode=1,
            cache_hit_threshold=0.5,
            log_dir=log_dir,
            engine_args=[
                "--max-model-len",
                "20480",
                "--num-kv-blocks",
                "1300",
                "--max-num-seqs",
                "1",
            ],
            **SIDE_BY_SIDE,
        )
    )
    topo.start(timeout_s=240)
    try:
        prefill, decode = topo.by_role("prefill")[0], topo.by_role("decode")[0]
        model = model_name(topo.gateway.url)

        def keep_busy():
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(
                    prefill.url + "/v1/completions",
                    timeout=120,
                    json={
                        "model": model,
                        "prompt": "keep busy",
                        "max_tokens": 19000,
                        "ignore_eos": True,
                    },
                )

        busy = threading.Thread(target=keep_busy, daemon=True)
        busy.start()
        wait_for(lambda: metric(prefill.url, "pdpool_num_requests_running") == 1, 10)
        aborted = metric(prefill.url, "pdpool_requests_aborted_total")
        body = json.dumps(
            {"model": model, "prompt": "a cold prompt that must wait " * 10, "max_tokens": 4}
        ).encode()
        with socket.create_connection(("127.0.0.1", topo.gateway.port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            # its prefill leg waits in the busy prefill engine's queue; then the client leaves
            wait_for(lambda: metric(prefill.url, "pdpool_num_requests_waiting") == 1, 10)
        took = wait_for(
            lambda: (
                metric(prefill.url, "pdpool_num_requests_waiting") == 0
                and metric(prefill.url, "pdpool_requests_aborted_total") > aborted
            ),
            5,
        )
        print(f"\nqueued prefill leg aborted {took:.2f}s after the client left")
        assert metric(prefill.url, "pdpool_num_requests_running") == 1  # still busy
        assert metric(decode.url, "pdpool_num_requests_running") == 0
        assert metric(decode.url, "pdpool_num_requests_waiting") == 0
    finally:
        cleanup(topo, keep_logs=False)
