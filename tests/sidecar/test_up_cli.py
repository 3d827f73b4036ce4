"""`pdpool up` as users run it: a process that prints the gateway URL, serves through it,
and stops every process it started on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from pdpool.up.topology import pdpool_command

from tests.support.e2e_helpers import engine_available

pytestmark = pytest.mark.slow


def sidecar_requests(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("pdpool_sidecar_requests_total{")
    )


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); its state says it is gone
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def start_up(tmp_path, decode: int) -> tuple[subprocess.Popen, Path]:
    """`pdpool up` (1 prefill, `decode` decode engines); its state file once it is ready."""
    if not engine_available():
        pytest.skip("pdpool engine (torch) is not installed")
    state = tmp_path / "state.json"
    argv = ["--port", "0", "--prefill", "1", "--decode", str(decode), "--state-file", str(state)]
    proc = subprocess.Popen(
        pdpool_command(
            "up", *argv, "--log-dir", str(tmp_path / "logs"), "--engine-arg=--num-kv-blocks=256"
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not state.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"pdpool up did not become ready: {proc.communicate()[0]}")
        time.sleep(0.3)
    return proc, state


def kill_children(state: Path) -> None:
    """Its children run in sessions of their own: leave none behind for later tests."""
    for child in json.loads(state.read_text())["children"]:
        if pid_alive(child["pid"]):
            os.killpg(child["pid"], signal.SIGKILL)


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """Those of `pids` still running after `seconds`."""
    deadline = time.monotonic() + seconds
    while [p for p in pids if pid_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if pid_alive(p)]


def test_up_serves_and_ctrl_c_stops_everything(tmp_path):
    body_done = False
    proc, state = start_up(tmp_path, decode=2)
    try:
        info = json.loads(state.read_text())
        pids = [c["pid"] for c in info["children"]]
        roles = [c["role"] for c in info["children"]]
        assert sorted(roles) == ["decode", "decode", "gateway", "prefill", "sidecar", "sidecar"]
        health = httpx.get(info["gateway_url"] + "/health", timeout=10).json()
        assert len(health["healthy"]) == 2  # both sidecars, each in front of its engine
        client = openai.OpenAI(base_url=info["gateway_url"] + "/v1", api_key="none")
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="hello " * 20, max_tokens=3)
        assert out.usage.completion_tokens == 3
        # a conversation keeps landing on one decode engine (its KV lives there)
        sidecars = [c["url"] for c in info["children"] if c["role"] == "sidecar"]
        before = [sidecar_requests(u) for u in sidecars]
        for turn in range(3):
            client.completions.create(
                model=model, prompt="same conversation " * 20 + "turn " * turn, max_tokens=2
            )
        grew = [sidecar_requests(u) - b for u, b in zip(sidecars, before, strict=True)]
        assert sorted(grew) == [0, 3]
        body_done = True
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            kill_children(state)
            if body_done:
                raise
            # else the test's own failure, already on its way out, is the one to report
    assert proc.returncode == 0
    assert f"OpenAI base URL: {info['gateway_url']}/v1" in output
    time.sleep(0.5)
    assert not [p for p in pids if pid_alive(p)]


def test_a_second_ctrl_c_while_stopping_still_stops_everything(tmp_path):
    proc, state = start_up(tmp_path, decode=1)
    pids = [c["pid"] for c in json.loads(state.read_text())["children"]]
    try:
        proc.send_signal(signal.SIGINT)
        # The second one lands while the first one's orderly stop waits for the children.
        for line in proc.stdout:
            if "pdpool up: stopping" in line:
                break
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output
        assert not gone_within(pids, 5)
    finally:
        proc.kill()
        kill_children(state)


def test_up_killed_leaves_no_process_behind(tmp_path):
    proc, state = start_up(tmp_path, decode=1)
    pids = [c["pid"] for c in json.loads(state.read_text())["children"]]
    try:
        proc.kill()  # SIGKILL: up runs no code of its own to stop them
        proc.wait(10)
        assert not gone_within(pids, 60)
    finally:
        kill_children(state)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--decode", "0"], "--decode must be in [1,"),
        (["--cache-hit-threshold", "2"], "[0, 1]"),
        (["--model", "/nonexistent/model"], ""),
        (["--otel", "-", "--otlp-traces-endpoint", "http://127.0.0.1:1"], "choose one"),
    ],
)
def test_up_bad_arguments_exit_with_one_line(argv, needle, tmp_path):
    done = subprocess.run(
        pdpool_command(
            "up", "--port", "0", "--log-dir", str(tmp_path), "--ready-timeout", "60", *argv
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and needle in done.stderr


def test_a_gateway_port_in_use_is_refused_before_any_engine_starts(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run(
            pdpool_command("up", "--port", str(port), "--log-dir", str(tmp_path / "logs")),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "starting" not in done.stdout  # refused before the engines, not after them
    assert not list((tmp_path / "logs").glob("*.log"))
    assert time.monotonic() - started < 60
