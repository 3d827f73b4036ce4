"""One mix of request priorities against an engine with one batch slot (`--max-num-seqs 1
--scheduling-policy priority`): a busy stream runs,
others queue behind it in a known order, the busy one is dropped (the engine aborts it),
and the order the others finish in is what the scheduler decided. Arrival order is made
certain by waiting for each request to show in `vllm:num_requests_waiting` (both engines
export it) before sending the next; each route is warmed up first and each queued request
runs enough steps that answers cannot overtake one another on their way back."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

# (name, priority, route) in the order they are sent after BUSY; lower priority runs first.
QUEUED = [
    ("low1", 5, "/v1/completions"),
    ("low2", 5, "/v1/chat/completions"),
    ("mid", 0, "/v1/completions"),
    ("low3", 5, "/v1/completions"),
    ("high", -1, "/v1/chat/completions"),
    ("high-tokens", -1, "/inference/v1/generate"),
]


def expected_order(queued: list[tuple[str, int, str]]) -> list[str]:
    """With one slot, vLLM's priority policy: the line by (priority, arrival)."""
    return [name for _, _, name in sorted((p, i, name) for i, (name, p, _) in enumerate(queued))]


EXPECTED = expected_order(QUEUED)
BUSY_PRIORITY = 5


def gauge(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


def _wait_gauge(
    url: str, name: str, value: float, finished: list[str], timeout: float = 60.0
) -> None:
    deadline = time.monotonic() + timeout
    while gauge(url, name) != value:
        assert not finished, f"{finished} finished before all queued: give busy more tokens"
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} never reached {value} at {url}")
        time.sleep(0.02)


def body(route: str, model: str, priority: int, max_tokens: int) -> dict[str, Any]:
    common = {"model": model, "priority": priority}
    if route == "/inference/v1/generate":
        return {
            **common,
            "token_ids": [11, 22, 33, 44, 55],
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        }
    sampling = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if route == "/v1/chat/completions":
        return {**common, **sampling, "messages": [{"role": "user", "content": "Hi there"}]}
    return {**common, **sampling, "prompt": "Once upon a time"}


def _busy(
    url: str, model: str, max_tokens: int, release: threading.Event, errors: list[str]
) -> None:
    """A long stream at BUSY_PRIORITY, read until `release`, then dropped."""
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "priority": BUSY_PRIORITY,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for _ in r.iter_lines():
            if release.is_set():
                return
    errors.append("busy: its stream ended before the others queued")


def run_mix(
    url: str,
    model: str,
    queued_tokens: int = 64,
    busy_tokens: int = 4000,
    on_queued: Optional[Callable[[], None]] = None,
    queued: list[tuple[str, int, str]] = QUEUED,
) -> list[str]:
    """The names of the queued requests in the order they finished (each answered 200);
    `on_queued` runs once all are queued behind the busy one. `busy_tokens`: as many as
    the context allows (the busy stream must outlast the queueing)."""
    finished: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()

    def send(name: str, route: str, priority: int) -> None:
        r = httpx.post(
            f"{url}{route}", json=body(route, model, priority, queued_tokens), timeout=600
        )
        with lock:
            finished.append(name)
            if r.status_code != 200:
                errors.append(f"{name}: {r.status_code} {r.text[:300]}")

    for _, priority, route in queued:  # each route's first answer may be slow: not in the mix
        r = httpx.post(f"{url}{route}", json=body(route, model, priority, 2), timeout=300)
        assert r.status_code == 200, r.text
    release = threading.Event()
    busy = threading.Thread(target=_busy, args=(url, model, busy_tokens, release, errors))
    busy.start()
    threads = []
    try:
        _wait_gauge(url, "vllm:num_requests_running", 1, finished)
        for n, (name, priority, route) in enumerate(queued, start=1):
            t = threading.Thread(target=send, args=(name, route, priority))
            t.start()
            threads.append(t)
            _wait_gauge(url, "vllm:num_requests_waiting", n, finished)
        if on_queued is not None:
            on_queued()
        assert not finished and not errors, (finished, errors)
    finally:
        release.set()
        busy.join(600)
        for t in threads:
            t.join(600)
    assert not errors, errors
    return finished
