"""`pdpool serve` runs its engine loop in a child process (the default): the answers are the
same as with the loop on a thread, and either process dying is handled: the engine's death
fails what was in flight and /health says so; the server's death takes the engine with it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from devtools.engine_procs import spawned_engine

# Starts engine processes: the full run's tier, not the fast one.
pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    # Every thread's: a restarted engine process is started from a worker thread.
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(FileNotFoundError):  # the thread ended meanwhile
            kids += [int(p) for p in task.read_text().split()]
    return kids


def _engine_child(pid: int) -> int:
    """The engine process among the server's children (multiprocessing's spawn child)."""
    for child in _children(pid):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            return child
    raise AssertionError(f"no engine process under {pid}: {_children(pid)}")


def _gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":  # exited; its parent (gone too) will not reap it
            return True
        time.sleep(0.1)
    return False


@contextmanager
def _busy(eng) -> Iterator[Iterator[str]]:
    """A long stream in flight on `eng`: the rest of its lines, after its first token."""
    long = {**BODY, "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{eng.url}/v1/completions", json=long, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        yield lines


BODY = {"prompt": [5, 6, 7, 8, 9] * 4, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
LEASE = {"kv_transfer_params": {"pdpool_lease": {"id": "no-such-lease"}}}


def test_thread_and_process_give_the_same_answers(tiny_qwen3, tmp_path):
    answers = {}
    for mode in ("--engine-process", "--no-engine-process"):
        with spawned_engine(tiny_qwen3, tmp_path, mode) as eng:
            whole = httpx.post(f"{eng.url}/v1/completions", json=BODY, timeout=60).json()
            streamed = []
            with httpx.stream(
                "POST",
                f"{eng.url}/v1/completions",
                json={**BODY, "stream": True, "return_token_ids": True},
                timeout=60,
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        streamed += json.loads(line[6:])["choices"][0]["token_ids"]
            metrics = httpx.get(f"{eng.url}/metrics", timeout=10).text
            answers[mode] = (whole["choices"][0]["text"], whole["usage"], streamed)
            assert len(streamed) == 24
            assert "vllm:generation_tokens_total" in metrics
            assert eng.metric("pdpool_kv_blocks_total") > 0
    assert answers["--engine-process"] == answers["--no-engine-process"]


def test_a_dead_engine_core_fails_its_requests_then_serves_again(tiny_qwen3, tmp_path):
    with spawned_engine(tiny_qwen3, tmp_path) as eng:
        child = _engine_child(eng.proc.pid)
        with _busy(eng) as lines:
            os.kill(child, signal.SIGKILL)
            rest = list(lines)  # the stream ends instead of hanging
        assert any('"error"' in line and "503" in line for line in rest), rest[-3:]
        assert rest[-1] == "data: [DONE]" or rest[-2:] == ["data: [DONE]", ""]
        health = httpx.get(f"{eng.url}/health", timeout=10)
        if health.status_code == 503:  # unless the new core is up already
            assert "engine core exited (code -9)" in health.json()["error"]["message"]
        # Nobody restarts anything: the server starts a new core in place.
        deadline = time.monotonic() + 60
        while True:
            after = httpx.post(f"{eng.url}/v1/completions", json=BODY, timeout=30)
            if after.status_code == 200:
                break
            assert after.status_code == 503 and "engine core" in after.text, after.text
            assert after.headers["retry-after"] == "1"
            # The other routes that wait on the core say the same (retryable), never 500.
            release = httpx.post(f"{eng.url}/pdpool/v1/kv/release", json=LEASE, timeout=60)
            assert release.status_code in (200, 503), release.text
            if release.status_code == 503:
                assert "engine core" in release.text and release.headers["retry-after"] == "1"
            assert time.monotonic() < deadline, "no new engine core within 60 s"
            time.sleep(0.5)
        assert eng.proc.poll() is None
        assert _engine_child(eng.proc.pid) != child
        assert httpx.get(f"{eng.url}/health", timeout=10).status_code == 200
        assert httpx.get(f"{eng.url}/ready", timeout=10).status_code == 200


def test_a_core_that_cannot_start_again_makes_the_server_exit_for_its_supervisor(
    tiny_qwen3, tmp_path
):
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen3, model)
    with spawned_engine(model, tmp_path) as eng:
        (model / "model.safetensors").unlink()  # the next core cannot load
        os.kill(_engine_child(eng.proc.pid), signal.SIGKILL)
        assert eng.proc.wait(60) == 2
        last = eng.log.read_text().strip().splitlines()[-1]
        assert last.startswith("pdpool serve: the engine core could not start again"), last


def test_the_server_process_does_not_load_torch(tiny_qwen3, tmp_path):
    with spawned_engine(tiny_qwen3, tmp_path) as eng:
        assert httpx.post(f"{eng.url}/v1/completions", json=BODY, timeout=60).status_code == 200
        maps = Path(f"/proc/{eng.proc.pid}/maps").read_text()
        assert "libtorch" not in maps
        assert "libtorch" in Path(f"/proc/{_engine_child(eng.proc.pid)}/maps").read_text()


def _niceness(pid: int, tid: int) -> int:
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])  # field 19 of proc(5)


def test_the_cpu_engine_core_yields_the_cpu_to_its_server(tiny_qwen3, tmp_path):
    from pdpool.engine.cpu_threads import CORE_NICE

    with spawned_engine(tiny_qwen3, tmp_path) as eng:
        assert httpx.post(f"{eng.url}/v1/completions", json=BODY, timeout=60).status_code == 200
        child = _engine_child(eng.proc.pid)
        # every thread of the core, the step loop's and the kernels' included
        threads = [int(t.name) for t in Path(f"/proc/{child}/task").iterdir()]
        assert len(threads) > 1
        assert {_niceness(child, t) for t in threads} == {CORE_NICE}
        assert _niceness(eng.proc.pid, eng.proc.pid) == 0  # the server keeps its priority


def test_the_engine_process_leaves_with_the_server(tiny_qwen3, tmp_path):
    with spawned_engine(tiny_qwen3, tmp_path) as eng:
        child = _engine_child(eng.proc.pid)
        with _busy(eng):
            os.kill(eng.proc.pid, signal.SIGKILL)  # the server alone: no chance to stop it
            eng.proc.wait(10)
        assert _gone(child, timeout=8), "the engine process outlived its server"


def test_sigterm_drains_then_stops_both(tiny_qwen3, tmp_path):
    with spawned_engine(tiny_qwen3, tmp_path) as eng:
        child = _engine_child(eng.proc.pid)
        os.killpg(eng.proc.pid, signal.SIGTERM)  # as a shell or `pdpool up` stops it
        # uvicorn re-raises the SIGTERM once it has drained and shut the app down
        assert eng.proc.wait(30) in (0, -signal.SIGTERM)
        assert _gone(child)


@pytest.mark.parametrize("mode", ["--engine-process", "--no-engine-process"])
def test_a_model_that_cannot_load_is_one_line_and_exit_2(tiny_qwen3, tmp_path, mode):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen3, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    proc = subprocess.run(
        [sys.executable, "-m", "pdpool.cli", "serve", str(broken), "--device", "cpu", mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("pdpool serve: ")
