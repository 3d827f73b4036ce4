"""Issue 36: nothing a client sends in a structured-output spec may hold up an engine. A
hostile spec sent to a real `pdpool serve` is refused with a 4xx (caps, a compile deadline)
or served, while an unrelated tiny completion sent during it completes at once; a spec
nested deeper than any check recurses is a 400, never a 500."""

from __future__ import annotations

import time

import httpx
import pytest

from devtools.engine_procs import spawned_engine
from tests.support.hostile_specs import (
    HOSTILE,
    choices,
    deep_schema_text,
    error_message,
    hostile_while_tiny,
    post,
    tiny_completion,
)

# Starts engine processes: the full run's tier, not the fast one.
pytestmark = pytest.mark.slow

# The tiny completion takes well under a second here; a bound far from both that and the
# 30 s+ compiles the issue measured shows it did not wait behind the hostile request.
NOT_BLOCKED_S = 10.0


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    with spawned_engine(tiny_qwen3, tmp_path_factory.mktemp("logs")) as eng:
        yield eng


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_spec_does_not_block_an_unrelated_completion(server, name):
    hostile, tiny = hostile_while_tiny(server.url, HOSTILE[name])
    print(f"{name}: hostile {hostile.status} in {hostile.seconds:.2f}s, tiny {tiny.seconds:.2f}s")
    assert tiny.status == 200, tiny.body
    assert tiny.seconds < NOT_BLOCKED_S
    assert 400 <= hostile.status < 500 or hostile.status == 200, hostile.body


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_spec_over_the_caps_is_400_naming_the_cap(server, name):
    answer = post(server.url, "/v1/completions", {"prompt": "x", **HOSTILE[name]})
    assert answer.status == 400, answer.body
    assert "--structured-max-" in (error_message(answer) or "")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_string_schema_150_deep_is_400_not_500(server, path):
    body = {"max_tokens": 4, "guided_json": deep_schema_text(150)}
    if path == "/v1/completions":
        body["prompt"] = "x"
    else:
        body["messages"] = [{"role": "user", "content": "x"}]
    answer = post(server.url, path, body)
    assert answer.status == 400, answer.body
    assert "nesting depth" in (error_message(answer) or "")


def test_a_schema_nested_within_the_cap_still_works(server):
    body = {"prompt": "x", "max_tokens": 200, "temperature": 0}
    body["structured_outputs"] = {"json": deep_schema_text(5), "disable_any_whitespace": True}
    answer = post(server.url, "/v1/completions", body)
    assert answer.status == 200, answer.body


def test_logit_bias_over_300_entries_is_400(server):
    body = {"prompt": "x", "max_tokens": 2, "logit_bias": {str(t): 1 for t in range(301)}}
    answer = post(server.url, "/v1/completions", body)
    assert answer.status == 400, answer.body
    assert "at most 300" in (error_message(answer) or "")
    body["logit_bias"] = {str(t): 1 for t in range(300)}
    assert post(server.url, "/v1/completions", body).status == 200


# --- a compile that overruns its deadline -------------------------------------------------
@pytest.fixture(scope="module")
def uncapped(tiny_qwen3, tmp_path_factory):
    """Caps raised so that a slow compile reaches the core; a short deadline, one overrun
    compile at most, and a short readiness threshold."""
    flags = [
        "--structured-max-choices", "100000",
        "--structured-max-bytes", "8000000",
        "--structured-compile-timeout-s", "2",
        "--structured-max-overrun-compiles", "1",
        "--ready-max-stall-s", "1.5",
    ]  # fmt: skip
    with spawned_engine(tiny_qwen3, tmp_path_factory.mktemp("logs"), *flags) as eng:
        yield eng


def test_a_compile_past_its_deadline_is_400_and_holds_no_one_else(uncapped):
    url = uncapped.url
    # 8,000 alternatives compile for 15 s and more on this machine's tiny vocabulary.
    slow = {"guided_choice": choices(8000)}
    hostile, tiny = hostile_while_tiny(url, slow, head_start_s=1.0)
    print(f"overrun: hostile {hostile.status} in {hostile.seconds:.2f}s, tiny {tiny.seconds:.2f}s")
    assert hostile.status == 400, hostile.body
    assert "did not compile within 2s" in (error_message(hostile) or "")
    assert hostile.seconds < NOT_BLOCKED_S
    assert tiny.status == 200 and tiny.seconds < NOT_BLOCKED_S
    # The core's reader still answers a lease release, and unguided requests are served.
    release = httpx.post(
        f"{url}/pdpool/v1/kv/release", json={"kv_transfer_params": {"x": 1}}, timeout=5
    )
    assert release.json() == {"released": False}
    # The overrun compile holds the one overrun slot: guided requests get 503 meanwhile.
    busy = post(url, "/v1/completions", {"prompt": "x", "guided_choice": ["a", "b"]})
    assert busy.status == 503, busy.body
    assert tiny_completion(url).status == 200
    # ...and readiness says so once it lasts past --ready-max-stall-s.
    ready = _ready_within(url, 503, timeout=10)
    assert "held up" in ready.text
    # Once the compile ends by itself, guided requests are taken again.
    assert _ready_within(url, 200, timeout=240).status_code == 200
    ok = post(url, "/v1/completions", {"prompt": "x", "guided_choice": ["yes", "no"]})
    assert ok.status == 200 and ok.body["choices"][0]["text"] in ("yes", "no")


def _ready_within(url: str, status: int, timeout: float) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{url}/ready", timeout=5)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.2)
