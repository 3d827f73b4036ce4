"""Guided JSON validity: how many outputs are RFC 8259 JSON (strict json.loads) that validate
against their schema (jsonschema), and how many forced tool calls parse, on a real
`pdpool serve` of the tiny random Qwen3 checkpoint (and, with --vllm, stock vLLM on the same
checkpoint, counted the same way). Validity is not a timing: a loaded machine only slows it.

    python benchmarks/structured_validity.py --seeds 10            # a quick check
    python benchmarks/structured_validity.py --seeds 200 --vllm    # ours and vLLM's

Workload: for each schema of devtools/json_schemas.py (maxLength strings, pattern, enum,
nested objects, arrays, bounded numbers) and `{"type": "json_object"}`, `--seeds` chat
requests per temperature (0 and 1) with `response_format: json_schema` (free whitespace, both
engines' default), the seed in the prompt so that greedy runs differ too; then tools:
tool_choice required and named (a function), whole and streamed. Failures are told apart:
`ctrl` parses only with json.loads(strict=False) (raw control characters in strings),
`cut` ended at max_tokens, `invalid` the rest; for tools `lying` counts answers with
finish_reason "tool_calls" and no calls. Results: benchmarks/results/structured_validity.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from typing import Any, Optional

import httpx
import jsonschema

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import print_table, write_json
from devtools.engine_procs import SpawnedEngine, wait_healthy
from devtools.json_schemas import SCHEMAS, TOOLS, calls_valid
from pdpool.up.topology import VLLM_ARGS, VLLM_ENV, free_port, served_model_name
from pdpool.up.topology import vllm_command as default_vllm

JSON_OBJECT = {"type": "object"}
Verdict = tuple[str, Optional[str]]  # (kind of outcome, the answer's text)
TOOL_CHOICES = {
    "required": "required",
    "named": {"type": "function", "function": {"name": "locate"}},
}


def tiny_model() -> str:
    """The tests' tiny_qwen3 checkpoint (2 layers, vocabulary 512), cached."""
    from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model

    out = os.path.join(os.path.expanduser("~"), ".cache", "pdpool", "bench-validity-tiny-qwen3")
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        write_tiny_model(out, TinyModelSpec(arch="qwen3", seed=0))
    return out


def ask(seed: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"record {seed} as JSON"}]


def judge(text: Optional[str], schema: dict[str, Any], reason: Optional[str]) -> str:
    """'ok', 'ctrl' (valid only with raw control characters allowed), 'cut' or 'invalid'."""
    for strict in (True, False):
        try:
            jsonschema.validate(json.loads(text or "", strict=strict), schema)
            return "ok" if strict else "ctrl"
        except (ValueError, jsonschema.ValidationError):
            pass
    return "cut" if reason == "length" else "invalid"


async def schema_case(client, url, model, kind, temperature, seed, max_tokens) -> Verdict:
    schema = JSON_OBJECT if kind == "json_object" else SCHEMAS[kind]
    rf = (
        {"type": "json_object"}
        if kind == "json_object"
        else {"type": "json_schema", "json_schema": {"name": kind, "schema": schema}}
    )
    body = {
        "model": model,
        "messages": ask(seed),
        "response_format": rf,
        "temperature": temperature,
        "seed": seed,
        "max_tokens": max_tokens,
    }
    r = await client.post(f"{url}/v1/chat/completions", json=body)
    if r.status_code != 200:
        return "error", r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"]
    return judge(text, schema, choice["finish_reason"]), text


async def tool_case(client, url, model, label, stream, temperature, seed, max_tokens) -> Verdict:
    verdict, calls, reason = await _tool_answer(client, url, model, label, stream, temperature,
                                                seed, max_tokens)  # fmt: skip
    return verdict or _judge_calls(calls, reason), json.dumps([calls, reason])


async def _tool_answer(client, url, model, label, stream, temperature, seed, max_tokens):
    body = {
        "model": model,
        "messages": ask(seed),
        "tools": TOOLS,
        "tool_choice": TOOL_CHOICES[label],
        "temperature": temperature,
        "seed": seed,
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if stream:
        calls, reason = await _streamed_calls(client, url, body)
    else:
        r = await client.post(f"{url}/v1/chat/completions", json=body)
        if r.status_code != 200:
            return "error", [], r.text
        choice = r.json()["choices"][0]
        reason = choice["finish_reason"]
        calls = [
            (c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"].get("tool_calls") or []
        ]
    return None, calls, reason


def _judge_calls(calls: list[tuple[str, str]], reason: Optional[str]) -> str:
    if reason == "tool_calls" and not calls:
        return "lying"
    if calls_valid(calls):
        return "ok"
    lenient = [(n, _lenient(a)) for n, a in calls]
    if calls and all(a is not None for _, a in lenient) and calls_valid(lenient):
        return "ctrl"
    return "cut" if reason == "length" else "invalid"


def _lenient(arguments: str) -> Optional[str]:
    try:
        return json.dumps(json.loads(arguments, strict=False))
    except ValueError:
        return None


async def _streamed_calls(client, url, body) -> tuple[list[tuple[str, str]], Optional[str]]:
    calls: dict[int, list[str]] = {}
    reason = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        pending = b""
        async for chunk in r.aiter_bytes():  # split at newlines only (see engine_vs_vllm)
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                reason = _read_event(line.decode().strip(), calls) or reason
    return [(calls[i][0], calls[i][1]) for i in sorted(calls)], reason


def _read_event(line: str, calls: dict[int, list[str]]) -> Optional[str]:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    for ch in json.loads(line[6:]).get("choices", []):
        for d in ch.get("delta", {}).get("tool_calls") or []:
            call = calls.setdefault(d["index"], ["", ""])
            fn = d.get("function") or {}
            call[0] += fn.get("name") or ""
            call[1] += fn.get("arguments") or ""
        if ch.get("finish_reason"):
            return ch["finish_reason"]
    return None


async def run_engine(url: str, model: str, args) -> tuple[list[dict[str, Any]], dict]:
    cases = [
        (
            kind,
            t,
            s,
            lambda c, k=kind, t=t, s=s: schema_case(c, url, model, k, t, s, args.max_tokens),
        )
        for kind in [*SCHEMAS, "json_object"]
        if kind in args.kinds
        for t in args.temperatures
        for s in range(args.seeds)
    ]
    cases += [
        (
            f"tools {label}{' streamed' if stream else ''}",
            t,
            s,
            lambda c, lb=label, st=stream, t=t, s=s: tool_case(
                c, url, model, lb, st, t, s, args.max_tokens
            ),
        )
        for label in TOOL_CHOICES
        if "tools" in args.kinds
        for stream in (False, True)
        for t in args.temperatures
        for s in range(args.tool_seeds or args.seeds)
    ]
    results: dict[tuple[str, float], Counter] = {}
    samples: dict[str, list[str]] = {}  # a failure or two of each case, for the record
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(name, t, seed, run):
            async with sem:
                verdict, sample = await run(client)
                results.setdefault((name, t), Counter())[verdict] += 1
                if verdict != "ok" and len(samples.setdefault(f"{name} t={t}", [])) < 2:
                    samples[f"{name} t={t}"].append(f"seed {seed}: {sample}")

        await asyncio.gather(*(one(*case) for case in cases))
    keys = dict.fromkeys((name, t) for name, t, _, _ in cases)  # in the cases' order
    return [_row(name, t, results[(name, t)]) for name, t in keys], samples


def _row(name: str, temperature: float, counts: Counter) -> dict[str, Any]:
    n = sum(counts.values())
    return {
        "case": name,
        "temperature": temperature,
        "n": n,
        "valid_pct": round(100.0 * counts["ok"] / n, 1),
        "ctrl": counts["ctrl"],
        "cut": counts["cut"],
        "invalid": counts["invalid"],
        "lying": counts["lying"],
        "error": counts["error"],
    }


def start_ours(model: str, log_dir: str) -> SpawnedEngine:
    from pathlib import Path

    return SpawnedEngine(Path(model), Path(log_dir), "--num-kv-blocks", "1024")


def start_vllm(model: str, log_dir: str, vllm_bin: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [
        vllm_bin, "serve", model, "--port", str(port),
        "--served-model-name", served_model_name(model), *VLLM_ARGS,
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ]  # fmt: skip
    log = os.path.join(log_dir, "vllm.log")
    with open(log, "wb") as out:  # the child holds its own copy
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **VLLM_ENV},
        )
    url = f"http://127.0.0.1:{port}"
    from pathlib import Path

    try:
        wait_healthy(url, proc, timeout=900, log=Path(log))
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc, url


def model_id(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def measure(engine: str, model: str, args) -> tuple[list[dict[str, Any]], dict]:
    t0 = time.monotonic()
    if engine == "ours":
        eng = start_ours(model, args.log_dir)
        try:
            eng.wait(300)
            rows, samples = asyncio.run(run_engine(eng.url, model_id(eng.url), args))
        finally:
            eng.stop()
    else:
        proc, url = start_vllm(model, args.log_dir, args.vllm_bin)
        try:
            rows, samples = asyncio.run(run_engine(url, model_id(url), args))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    print(f"{engine}: {time.monotonic() - t0:.0f} s", flush=True)
    return [{"engine": engine, **r} for r in rows], samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=200, help="requests per schema and temperature")
    ap.add_argument("--tool-seeds", type=int, default=0, help="per tool case (default: --seeds)")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--model", default=None, help="checkpoint (default: the tiny Qwen3)")
    ap.add_argument("--vllm", action="store_true", help="also stock vLLM on the same model")
    ap.add_argument("--vllm-bin", default=None)
    ap.add_argument("--vllm-seeds", type=int, default=0, help="vLLM's seeds (default: --seeds)")
    ap.add_argument(
        "--kinds",
        default=",".join([*SCHEMAS, "json_object", "tools"]),
        help="the cases to run, comma-separated (default: all)",
    )
    ap.add_argument("--log-dir", default="/tmp/pdpool-structured-validity")
    args = ap.parse_args()
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.kinds = set(args.kinds.split(","))
    unknown = args.kinds - {*SCHEMAS, "json_object", "tools"}
    if unknown:
        ap.error(f"unknown --kinds {sorted(unknown)}; known: {[*SCHEMAS, 'json_object', 'tools']}")
    args.vllm_bin = args.vllm_bin or default_vllm()
    os.makedirs(args.log_dir, exist_ok=True)
    model = args.model or tiny_model()
    rows, samples = measure("ours", model, args)
    failures = {"ours": samples}
    if args.vllm:
        args.seeds = args.vllm_seeds or args.seeds  # its cut answers run to max_tokens: slow
        args.tool_seeds = min(args.tool_seeds or args.seeds, args.seeds)
        theirs, failures["vllm"] = measure("vllm", model, args)
        rows += theirs
    print_table(rows, "strict json.loads + jsonschema validity (%), failures by kind")
    write_json(
        "structured_validity",
        {
            "model": model,
            "seeds_per_row": "the rows' n",
            "max_tokens": args.max_tokens,
            "rows": rows,
            "failure_samples": failures,
        },
    )


if __name__ == "__main__":
    main()
