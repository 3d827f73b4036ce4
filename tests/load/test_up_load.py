"""What production sends, through the gateway of `pdpool up --prefill 1 --decode 2` (its
supervisor restarts what dies): an engine core SIGKILLed under a live greedy stream, and a
mixed burst while a sidecar and a decode engine's server are killed. A path always remains,
so nothing may be answered 5xx; streams move to the other decode engine, exactly."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from devtools.load_mix import (
    HealthWatch,
    PromptMaker,
    health_problems,
    load_during,
    memory_problems,
    outcome_problems,
    scrape,
)
from devtools.load_targets import (
    blocks_in_use,
    inject_faults,
    kill_core,
    leaked_blocks,
    memory,
    outages,
    time_recovery,
)
from tests.support.load_suite import (
    BLOCKS_IDLE_WAIT_S,
    MEMORY_GROWTH_LIMIT,
    RECOVERY_LIMIT_S,
    mix_spec,
    no_problems,
)

pytestmark = pytest.mark.slow

STREAM_TOKENS = 300


def greedy_body(route: str, spec, mk: PromptMaker) -> dict:
    body = {
        "model": spec.model,
        "max_tokens": STREAM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if route.endswith("/chat/completions"):
        return {**body, "messages": [{"role": "user", "content": mk.text(120)}]}
    return {**body, "prompt": mk.text(120)}


def stream_text(url: str, route: str, body: dict, on_first_text=None) -> tuple[str, dict]:
    """Streams `body`; calls on_first_text(response) once text has arrived. Returns the text
    and the usage; fails on an error event or a stream without [DONE]."""
    text, usage, done, called = [], {}, False, False
    with httpx.stream("POST", url + route, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            if on_first_text is not None and not called and "".join(text):
                on_first_text(r)
                called = True
    assert done, "the stream ended without [DONE]"
    return "".join(text), usage


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_engine_core_killed_mid_stream_the_stream_moves_on_exactly(up, model_dir, route):
    """The gateway migrates the live greedy stream to the other decode engine: the client
    gets the uninterrupted answer; the killed engine serves again by itself."""
    spec = mix_spec(up.engines()[0].url, model_dir)
    body = greedy_body(route, spec, PromptMaker(model_dir, seed=len(route)))
    reference, _ = stream_text(up.url, route, body)
    kills = []

    def kill_its_core(response: httpx.Response) -> None:
        kills.append(kill_core(up.decode_behind(response.headers["x-pdpool-backend"])))

    with HealthWatch(up.url) as watch:
        text, usage = stream_text(up.url, route, body, kill_its_core)
        decode = up.node(kills[0].node)
        kill = time_recovery(kills[0], decode.url, spec.model, RECOVERY_LIMIT_S)
    print(f"\n{route}: {kill.node}'s core killed; served again after {kill.recovered_s}s")
    assert text == reference
    assert usage.get("completion_tokens") == STREAM_TOKENS
    assert kill.recovered_s is not None, (
        f"{kill.node} did not serve again within {RECOVERY_LIMIT_S:.0f}s "
        f"(probes: {sorted(set(kill.probes.statuses), key=str)})"
    )
    problems = health_problems(watch)
    assert not problems, no_problems(problems)


# Killed one after another while the load runs, each once the gateway routes to both
# sidecars again: a path always remains.
FAULTS = (("sidecar-0", "sidecar"), ("decode-1", "engine-server"))


def test_mixed_bursts_through_the_gateway_while_a_sidecar_and_an_engine_die(up, model_dir):
    spec = mix_spec(up.engines()[0].url, model_dir)
    idle, rss = blocks_in_use(up), memory(up)
    migrations = scrape(up.url).get("pdpool_gateway_migrations_total", 0.0)

    async def faults() -> list:
        return await asyncio.to_thread(inject_faults, up, FAULTS, spec.model, RECOVERY_LIMIT_S)

    with HealthWatch(up.url) as watch:
        outcomes, kills = asyncio.run(load_during(up.url, spec, 24, faults, timeout_s=120))
    windows = outages(kills, no_path=False)
    migrated = scrape(up.url).get("pdpool_gateway_migrations_total", 0.0) - migrations
    print(f"\n{len(outcomes)} requests, {migrated:.0f} streams migrated")
    print("\n".join(str(k.row()) for k in kills))
    problems = outcome_problems(outcomes, windows) + health_problems(watch, windows)
    problems += [f"{k.node} did not serve again" for k in kills if k.recovered_s is None]
    problems += leaked_blocks(up, idle, BLOCKS_IDLE_WAIT_S)
    problems += memory_problems(rss, memory(up), MEMORY_GROWTH_LIMIT)
    assert not problems, no_problems(problems) + "\n" + up.server_errors()
