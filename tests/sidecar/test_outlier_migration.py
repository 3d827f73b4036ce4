"""Outlier detection and stream-migration bookkeeping, without I/O."""

from __future__ import annotations

from pdpool.sidecar.gateway import migration
from pdpool.sidecar.routing.outlier import OutlierDetector


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_consecutive_failures_eject_and_a_probe_after_the_ejection_time_readmits():
    clock, events = Clock(), []
    d = OutlierDetector(
        consecutive_failures=3,
        probe_failures=2,
        base_ejection_s=2.0,
        max_ejection_s=10.0,
        clock=clock,
        on_eject=lambda e, r: events.append(("eject", e, r)),
        on_readmit=lambda e: events.append(("readmit", e)),
    )
    d.failure("a", "timeout")
    d.failure("a", "timeout")
    d.success("a")  # the streak ends
    assert not d.failure("a", "timeout") and not d.is_ejected("a")
    d.failure("a", "timeout")
    assert d.failure("a", "timeout") and d.available(["a", "b"]) == ["b"]
    assert d.ejected_event("a").is_set()
    d.probe("a", True)  # too early: stays out
    assert d.is_ejected("a")
    clock.t += 2.0
    d.probe("a", True)
    assert not d.is_ejected("a") and not d.ejected_event("a").is_set()
    # a second ejection soon after lasts twice as long; probes eject after two failures
    d.probe("a", False)
    assert not d.is_ejected("a")
    d.probe("a", False)
    assert d.is_ejected("a")
    clock.t += 3.0
    d.probe("a", True)
    assert d.is_ejected("a")
    clock.t += 1.0
    d.probe("a", True)
    assert not d.is_ejected("a")
    assert events == [
        ("eject", "a", "timeout"),
        ("readmit", "a"),
        ("eject", "a", "probe"),
        ("readmit", "a"),
    ]


def test_chat_stream_state_builds_an_exact_continuation_and_client_shaped_chunks():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 10,
        "min_tokens": 4,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    assert migration.can_migrate("/v1/chat/completions", body)
    assert not migration.can_migrate("/v1/chat/completions", {**body, "n": 2})
    # a continuation would count the sent tokens as its prompt, not its output
    assert not migration.can_migrate("/v1/chat/completions", {**body, "presence_penalty": 1})
    assert not migration.can_migrate("/v1/chat/completions", {**body, "frequency_penalty": -1})
    assert migration.can_migrate("/v1/chat/completions", {**body, "repetition_penalty": 1.2})
    st = migration.StreamState("/v1/chat/completions", body)
    opening = st.observe(
        {
            "id": "chatcmpl-1",
            "created": 1,
            "model": "m",
            "object": "chat.completion.chunk",
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        },
        False,
    )
    assert "prompt_token_ids" not in opening
    for ids, text in (([7], "a"), ([8], "b"), ([9], "")):  # token 9's text held back
        out = st.observe(
            {
                "id": "chatcmpl-1",
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": text},
                        "token_ids": ids,
                        "finish_reason": None,
                    }
                ],
            },
            False,
        )
        assert "token_ids" not in out["choices"][0]
    assert st.can_continue()
    cont = st.continuation()
    assert cont["prompt"] == [1, 2, 3, 7, 8] and cont["max_tokens"] == 8
    assert cont["min_tokens"] == 2 and "messages" not in cont and cont["return_token_ids"]
    chunk = st.observe(
        {
            "id": "cmpl-x",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "cd", "token_ids": [9, 10], "finish_reason": None}],
        },
        True,
    )
    assert chunk["id"] == "chatcmpl-1" and chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0]["delta"] == {"content": "cd"}
    assert "stop_reason" not in chunk["choices"][0]  # a chat stream's last chunk has it
    last = {"index": 0, "text": "e", "token_ids": [11], "finish_reason": "stop"}
    chunk = st.observe({"id": "cmpl-x", "choices": [{**last, "stop_reason": "zz"}]}, True)
    assert chunk["choices"][0]["finish_reason"] == "stop"
    assert chunk["choices"][0]["stop_reason"] == "zz"
    usage = st.observe(
        {
            "id": "cmpl-x",
            "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13},
        },
        True,
    )
    assert usage["usage"]["prompt_tokens"] == 3 and usage["usage"]["completion_tokens"] == 10


def test_ejected_endpoints_become_due_when_their_time_has_passed():
    clock = Clock()
    d = OutlierDetector(probe_failures=1, base_ejection_s=2.0, clock=clock)
    d.probe("a", False)
    assert d.is_ejected("a") and d.due(["a", "b"]) == []
    clock.t += 2.0
    assert d.due(["a", "b"]) == ["a"]  # not "b": it was never ejected
    d.probe("a", True)
    assert d.due(["a"]) == [] and not d.is_ejected("a")


def test_a_continuation_does_not_ask_for_the_prompts_logprobs_again():
    # The first leg answered them; the continuation's prompt is the longer one, whose rows
    # an engine computes without its prefix cache when they are asked for.
    body = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 4, "prompt_logprobs": 0}
    assert migration.can_migrate("/v1/completions", body)
    st = migration.StreamState("/v1/completions", body)
    st.observe({"id": "cmpl-1", "prompt_token_ids": [1, 2], "choices": []}, False)
    st.observe({"id": "cmpl-1", "choices": [{"index": 0, "text": "a", "token_ids": [7]}]}, False)
    cont = st.continuation()
    assert cont["prompt"] == [1, 2, 7] and "prompt_logprobs" not in cont
