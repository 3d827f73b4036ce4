"""Hostile structured-output specs against one `pdpool serve` (issue 36): each spec's
answer (status, seconds) and the latency of a tiny unrelated completion sent while it is
in flight, next to that completion's latency alone.

    python benchmarks/hostile_structured.py            # tiny random model, CPU
    python benchmarks/hostile_structured.py --no-overrun

Rows: the three specs of the issue against the default caps (refused up front with a
400 naming the cap), then, on a second engine with the caps raised and a 5 s compile
deadline, 8,000 guided_choice alternatives that compile far longer than that: the 400 of
the deadline, and the tiny completion meanwhile. Results:
benchmarks/results/hostile_structured.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import print_table, write_json
from devtools.engine_procs import spawned_engine


# The specs of the issue (tests/structured/test_hostile_specs.py sends the same ones).
def choices(n: int) -> list[str]:
    return [f"option-number-{i}-abcdefgh" for i in range(n)]


def deep_schema_text(depth: int) -> str:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return json.dumps(schema)


WIDE = {f"property_{i}": {"type": "string"} for i in range(40_000)}
HOSTILE: dict[str, dict[str, Any]] = {
    "guided_choice 20k options": {"guided_choice": choices(20_000)},
    "guided_json 40k properties": {"guided_json": {"type": "object", "properties": WIDE}},
    "guided_json string 150 deep": {"guided_json": deep_schema_text(150)},
}


def post(url: str, body: dict[str, Any], timeout: float = 600.0) -> tuple[int, float, Any]:
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)
        status, payload = r.status_code, r.json()
    except httpx.TimeoutException:
        status, payload = 0, None
    return status, time.monotonic() - t0, payload


def tiny_completion(url: str) -> tuple[int, float, Any]:
    return post(url, {"prompt": "hello there", "max_tokens": 4, "temperature": 0}, 120.0)


def error_message(payload: Any) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    return str(error.get("message")) if isinstance(error, dict) else ""


RAISED_CAPS = [
    "--structured-max-choices", "100000",
    "--structured-max-bytes", "8000000",
    "--structured-compile-timeout-s", "5",
]  # fmt: skip


def _row(name: str, url: str, fields: dict) -> dict:
    """The hostile request, and (1 s later, once it reached the engine) the tiny one."""
    out: dict[str, tuple[int, float, Any]] = {}
    body = {"prompt": "pick one", "max_tokens": 8, "temperature": 0, **fields}
    thread = threading.Thread(target=lambda: out.update(hostile=post(url, body)))
    thread.start()
    time.sleep(1.0)
    tiny = tiny_completion(url)
    thread.join()
    status, seconds, payload = out["hostile"]
    return {
        "hostile spec": name,
        "status": status,
        "answer_s": round(seconds, 2),
        "tiny_completion_s": round(tiny[1], 3),
        "tiny_status": tiny[0],
        "message": error_message(payload)[:90],
    }


def _alone(url: str) -> float:
    tiny_completion(url)  # warm-up
    return statistics.median(tiny_completion(url)[1] for _ in range(5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a checkpoint folder (default: a tiny random Qwen3)")
    ap.add_argument("--no-overrun", action="store_true", help="skip the deadline row")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hostile-"))
    model = Path(args.model) if args.model else work / "tiny"
    if not args.model:
        from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model

        write_tiny_model(model, TinyModelSpec(arch="qwen3", seed=0))
    rows = []
    with spawned_engine(model, work) as eng:
        alone = _alone(eng.url)
        rows += [_row(name, eng.url, fields) for name, fields in HOSTILE.items()]
    if not args.no_overrun:
        with spawned_engine(model, work, *RAISED_CAPS) as eng:
            fields = {"guided_choice": choices(8000)}
            rows.append(_row("guided_choice 8k, caps raised, 5 s deadline", eng.url, fields))
    print_table(rows, f"hostile specs (tiny completion alone: {alone:.3f}s, median of 5)")
    path = write_json(
        "hostile_structured",
        {"tiny_completion_alone_s": round(alone, 3), "rows": rows, "load": os.getloadavg()},
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
