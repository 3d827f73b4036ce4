"""Structured-output specs that cost an engine a lot to check or compile (issue 36), and a
probe that measures a tiny unrelated completion while one is in flight. Shared by
tests/structured/test_hostile_specs.py and benchmarks/hostile_structured.py."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import httpx


def choices(n: int) -> list[str]:
    return [f"option-number-{i}-abcdefgh" for i in range(n)]


def wide_schema(n: int) -> dict[str, Any]:
    props = {f"property_{i}": {"type": "string"} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def deep_schema_text(depth: int) -> str:
    """A string schema nested `depth` objects deep, as JSON text: inside a body it does not
    count toward the body's own nesting cap."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return json.dumps(schema)


# name -> the body's structured-output fields
HOSTILE: dict[str, dict[str, Any]] = {
    "guided_choice 20k options": {"guided_choice": choices(20_000)},
    "guided_json 40k properties": {"guided_json": wide_schema(40_000)},
    "guided_json string 150 deep": {"guided_json": deep_schema_text(150)},
}


@dataclass
class Answer:
    status: int
    seconds: float
    body: Any


def post(url: str, path: str, body: dict[str, Any], timeout: float = 300.0) -> Answer:
    t0 = time.monotonic()
    try:
        r = httpx.post(url + path, json=body, timeout=timeout)
        status, payload = r.status_code, r.json() if r.content else None
    except httpx.TimeoutException:
        status, payload = 0, None  # no answer within `timeout`
    return Answer(status, time.monotonic() - t0, payload)


def tiny_completion(url: str, timeout: float = 60.0) -> Answer:
    body = {"prompt": "hello there", "max_tokens": 4, "temperature": 0}
    return post(url, "/v1/completions", body, timeout)


def hostile_while_tiny(
    url: str, fields: dict[str, Any], path: str = "/v1/completions", head_start_s: float = 0.5
) -> tuple[Answer, Answer]:
    """Sends a guided request with `fields`, then (after `head_start_s`, for it to reach the
    engine) a tiny unguided completion; (the hostile answer, the tiny one)."""
    out: dict[str, Answer] = {}
    body = {"max_tokens": 8, "temperature": 0, **fields}
    if path == "/v1/completions":
        body["prompt"] = "pick one"
    else:
        body["messages"] = [{"role": "user", "content": "pick one"}]

    def send() -> None:
        out["hostile"] = post(url, path, body)

    thread = threading.Thread(target=send)
    thread.start()
    time.sleep(head_start_s)
    tiny = tiny_completion(url)
    thread.join()
    return out["hostile"], tiny


def error_message(answer: Answer) -> Optional[str]:
    body = answer.body
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    return None
