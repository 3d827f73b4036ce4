"""Random hostile requests (devtools/api_fuzz.py) against a real `pdpool serve`: every one is
answered 2xx or 4xx with a message, none drops the connection or hangs, and the engine serves
a plain completion afterwards."""

from __future__ import annotations

import httpx
import pytest

from devtools.api_fuzz import problem_of, run
from devtools.engine_procs import SpawnedEngine

OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"


def test_the_judge_names_what_a_client_is_not_owed():
    assert problem_of(500, b"HTTP/1.1 500 x\r\n\r\n{}", False) == "status 500"
    assert problem_of("timeout", b"", False) == "timeout"
    assert problem_of(400, b"HTTP/1.1 400 x\r\n\r\n{}", False) == "status 400 without a message"
    assert problem_of(200, OK + b"data: {}\n\n", True) == "a 200 stream without [DONE]"
    assert problem_of(200, OK + b'data: {"error": 1}\n\ndata: [DONE]\n\n', True)
    assert problem_of(200, OK + b"data: {}\n\ndata: [DONE]\n\n", True) is None
    assert problem_of(400, b'HTTP/1.1 400 x\r\n\r\n{"message": "why"}', False) is None


@pytest.mark.slow
def test_hostile_requests_get_an_answer_and_the_engine_serves_on(tiny_qwen3, tmp_path):
    eng = SpawnedEngine(tiny_qwen3, tmp_path).wait()
    try:
        tally = run(eng.url, requests=600, seed=11)
        assert not tally.problems, tally.problems[:3]
        assert tally.statuses.get("200", 0) > 100 and tally.statuses.get("400", 0) > 300, tally
        r = httpx.post(eng.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    finally:
        eng.stop()
