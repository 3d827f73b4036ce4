"""What production sends, against one `pdpool serve` with default flags (its engine core in
a process of its own): bursts of long prompts, over-long prompts, a 10 MB prompt, a killed
engine core, and a mixed burst. Throughout: /health answers within 1 s, nothing is answered
5xx unless no path could serve, no stream ends without [DONE] or an error event, hostile
structured-output specs get 400 while valid ones parse; afterwards
the KV blocks in use are back to idle and memory has stayed bounded."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from devtools.json_schemas import SCHEMAS, strictly_valid
from devtools.load_mix import (
    CHAT,
    COMPLETIONS,
    REFUSED,
    TOO_LONG,
    HealthWatch,
    LoadClient,
    Outage,
    PromptMaker,
    Shot,
    build_units,
    health_problems,
    huge_prompt,
    memory_problems,
    outcome_problems,
)
from devtools.load_targets import (
    blocks_in_use,
    kill_core,
    leaked_blocks,
    memory,
    probe,
    time_recovery,
)
from tests.support.hostile_specs import HOSTILE
from tests.support.load_suite import (
    BLOCKS_IDLE_WAIT_S,
    MEMORY_GROWTH_LIMIT,
    RECOVERY_LIMIT_S,
    mix_spec,
    no_problems,
    send,
)

pytestmark = pytest.mark.slow


def completion(spec, prompt, max_tokens: int, **extra) -> Shot:
    body = {"model": spec.model, "prompt": prompt, "max_tokens": max_tokens, **extra}
    return Shot("completion", COMPLETIONS, body)


def after_checks(serve, spec) -> list[str]:
    """The engine is healthy and serves a normal request."""
    problems = []
    health = httpx.get(serve.url + "/health", timeout=5)
    if health.status_code != 200:
        problems.append(f"/health after the load: {health.status_code} {health.text[:200]}")
    status = probe(serve.url, spec.model, timeout_s=30)
    if status != 200:
        problems.append(f"a normal request after the load: {status}")
    return problems


def test_64_concurrent_3000_token_prompts_are_all_answered(serve, model_dir):
    spec = mix_spec(serve.url, model_dir)
    mk = PromptMaker(model_dir, seed=64)
    shots = [completion(spec, mk.text(3000), 4) for _ in range(64)]
    idle, rss = blocks_in_use(serve), memory(serve)
    with HealthWatch(serve.url) as watch:
        outcomes = send(serve.url, shots, spec, burst=64)
    problems = outcome_problems(outcomes) + health_problems(watch) + after_checks(serve, spec)
    problems += leaked_blocks(serve, idle, BLOCKS_IDLE_WAIT_S)
    problems += memory_problems(rss, memory(serve), MEMORY_GROWTH_LIMIT)
    assert not problems, no_problems(problems)


def test_8_concurrent_over_long_prompts_each_get_400(serve, model_dir):
    spec = mix_spec(serve.url, model_dir)
    mk = PromptMaker(model_dir, seed=8)
    limit = spec.max_model_len
    prompts = [
        mk.ids(limit + 1),  # one token over
        mk.ids(limit - 4),  # fits alone, not with its max_tokens
        mk.ids(limit * 2),
        mk.text(limit + 200),
        mk.text(limit * 3),
        mk.ids(limit + 64),
        mk.text(limit + 1000),
        mk.ids(limit),
    ]
    shots = [
        Shot("overlong", COMPLETIONS, completion(spec, p, 16, stream=i % 2 == 1).body, TOO_LONG)
        for i, p in enumerate(prompts)
    ]
    with HealthWatch(serve.url) as watch:
        outcomes = send(serve.url, shots, spec, burst=8)
    problems = outcome_problems(outcomes) + health_problems(watch) + after_checks(serve, spec)
    assert not problems, no_problems(problems)


def test_a_10mb_prompt_is_refused_while_health_keeps_answering(serve, model_dir):
    spec = mix_spec(serve.url, model_dir)
    limit = serve_max_body_bytes()
    assert spec.huge_prompt_bytes < limit  # under --max-body-bytes: read whole, then refused
    shot = huge_prompt(spec, PromptMaker(model_dir), random.Random(10))
    assert shot.expect == REFUSED
    rss = memory(serve)
    with HealthWatch(serve.url, every_s=0.1) as watch:
        outcomes = send(serve.url, [shot], spec, burst=1)
    problems = outcome_problems(outcomes) + health_problems(watch) + after_checks(serve, spec)
    problems += memory_problems(rss, memory(serve), MEMORY_GROWTH_LIMIT)
    assert not problems, no_problems(problems)


def serve_max_body_bytes() -> int:
    """`pdpool serve`'s default --max-body-bytes (32 MiB)."""
    from pdpool.protocol import DEFAULT_MAX_BODY_BYTES

    return DEFAULT_MAX_BODY_BYTES


async def kill_core_under_load(serve, spec, mk) -> tuple:
    """Two streams and two whole requests in flight; the engine core is SIGKILLed once the
    streams are flowing. Returns (kill, outcomes of the requests in flight)."""
    client = LoadClient(serve.url, timeout_s=120)
    shots = [
        completion(spec, mk.text(64), 1500, ignore_eos=True, stream=s)
        for s in (True, True, False, False)
    ]
    try:
        tasks = [asyncio.create_task(client.send(s)) for s in shots]
        await asyncio.wait_for(client.streaming.wait(), 60)
        kill = kill_core(serve.nodes()[0])
        outcomes = await asyncio.gather(*tasks)
    finally:
        await client.close()
    return kill, outcomes


def test_a_killed_engine_core_is_restarted_in_place(serve, model_dir):
    """No one restarts `pdpool serve` by hand: requests get 503 (streams an error event)
    while its core is down, then 200 again within ~30 s."""
    spec = mix_spec(serve.url, model_dir)
    with HealthWatch(serve.url) as watch:
        kill, in_flight = asyncio.run(kill_core_under_load(serve, spec, PromptMaker(model_dir)))
        kill = time_recovery(kill, serve.url, spec.model, RECOVERY_LIMIT_S)
    outage = Outage("engine core killed", kill.at, kill.at + (kill.recovered_s or 1e9), True)
    problems = []
    for o in in_flight:
        # A stream already answering ends with an error event; anything else gets 503.
        if not (o.status == 503 or (o.streamed and o.status == 200 and o.error_event)):
            problems.append(f"a request in flight: {o.klass}, {o.status}: {o.message[:200]}")
    refused = {s for s in kill.probes.statuses if s != 200}
    if refused - {503}:
        problems.append(f"requests while the core was down got {sorted(refused, key=str)}")
    if kill.recovered_s is None:
        problems.append(f"the engine did not serve again within {RECOVERY_LIMIT_S:.0f}s")
    problems += health_problems(watch, [outage])
    if kill.recovered_s is not None:
        problems += after_checks(serve, spec)
    print(f"\nengine core killed: served again after {kill.recovered_s}s")
    assert not problems, no_problems(problems)


def test_mixed_burst_on_one_engine(serve, model_dir):
    """Every kind of request at once: short and long prompts (up to max_model_len), streams
    and not, chats and completions, n>1 with logprobs, clients that leave mid-stream,
    conversations sharing prefixes, bodies near and over the size limit, over-long ones."""
    spec = mix_spec(serve.url, model_dir)
    units = build_units(spec, 48, seed=7)
    idle, rss = blocks_in_use(serve), memory(serve)
    with HealthWatch(serve.url) as watch:
        outcomes = send(serve.url, units, spec, burst=48)
    kinds = {o.kind for o in outcomes}
    assert {"leave", "n_logprobs", "turn", "overlong", "oversize_body", "limit"} <= kinds
    problems = outcome_problems(outcomes) + health_problems(watch) + after_checks(serve, spec)
    problems += leaked_blocks(serve, idle, BLOCKS_IDLE_WAIT_S)
    problems += memory_problems(rss, memory(serve), MEMORY_GROWTH_LIMIT)
    assert not problems, no_problems(problems)


def hostile_structured_shots(spec, mk) -> list[Shot]:
    """Specs that once held an engine (huge choice lists and schemas, deep nesting, a
    vocabulary-wide logit_bias, a length the grammar cannot enforce) on both OpenAI routes,
    each answered 400; beside them valid guided requests and plain ones, answered 200."""
    bad = []
    for name, fields in HOSTILE.items():
        bad.append(Shot(f"hostile {name}", COMPLETIONS, completion_body(spec, mk, fields)))
        chat_fields = {**fields, "messages": [{"role": "user", "content": mk.text(16)}]}
        bad.append(Shot(f"hostile chat {name}", CHAT, {"model": spec.model, **chat_fields}))
    unenforceable = {"guided_json": {"type": "string", "maxLength": 8, "pattern": "^[a-z]+$"}}
    bad.append(Shot("unenforceable", COMPLETIONS, completion_body(spec, mk, unenforceable)))
    bias = {"logit_bias": {str(i): 1.0 for i in range(301)}}
    bad.append(Shot("logit_bias 301", COMPLETIONS, completion_body(spec, mk, bias)))
    bad = [Shot(s.kind, s.route, s.body, TOO_LONG) for s in bad]  # 400 is the right answer
    good = [
        Shot(f"guided {name}", COMPLETIONS, guided_body(spec, mk, name))
        for name in ("max_length", "enum", "nested")
        for _ in range(2)
    ]
    good += [completion(spec, mk.text(200), 32, stream=i % 2 == 0) for i in range(12)]
    return bad + good


def completion_body(spec, mk, fields: dict) -> dict:
    return {"model": spec.model, "prompt": mk.text(24), "max_tokens": 400, **fields}


def guided_body(spec, mk, schema_name: str) -> dict:
    return completion_body(spec, mk, {"guided_json": SCHEMAS[schema_name]})


def test_hostile_structured_outputs_amid_a_burst(serve, model_dir):
    spec = mix_spec(serve.url, model_dir)
    shots = hostile_structured_shots(spec, PromptMaker(model_dir, seed=36))
    idle = blocks_in_use(serve)
    with HealthWatch(serve.url) as watch:
        outcomes = send(serve.url, shots, spec, burst=len(shots))
    problems = outcome_problems(outcomes) + health_problems(watch) + after_checks(serve, spec)
    for o in outcomes:
        text = o.text.get(0, "")
        schema = SCHEMAS.get(o.kind.removeprefix("guided "))
        if o.kind.startswith("guided ") and o.status == 200 and not strictly_valid(text, schema):
            problems.append(f"{o.kind}: not valid JSON of its schema: {text!r}")
    problems += leaked_blocks(serve, idle, BLOCKS_IDLE_WAIT_S)
    assert not problems, no_problems(problems)
