"""`pdpool serve` on CPU leaves one core to its HTTP server for decode steps and gives steps
with many prompt tokens every core, unless told otherwise: the policy's arithmetic, the
cgroup limit it reads, the switch between the two counts as steps come, and a real server
that applies it."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import re
import time
from pathlib import Path

import pytest
import torch

from devtools.engine_procs import SpawnedEngine
from pdpool.engine import serve_cli
from pdpool.engine.cpu_threads import (
    OPENMP_SPIN_ROUNDS,
    WIDE_STEP_TOKENS,
    StepThreads,
    WideStepThreads,
    quiet_openmp_spin,
    serving_cpu_threads,
    serving_prefill_threads,
    step_thread_count,
)
from pdpool.cpu_cores import cgroup_quota_cores, usable_cores

# Starts engine processes: the full run's tier, not the fast one.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("cores,threads", [(1, 1), (2, 1), (3, 2), (16, 15)])
def test_all_cores_but_one_for_the_model(cores, threads):
    assert serving_cpu_threads(cores, environ={}) == threads


@pytest.mark.parametrize("cores,in_process,threads", [(1, 1, 1), (2, 2, 1), (16, 16, 15)])
def test_every_core_for_prompt_steps_when_the_engine_has_its_own_process(
    cores, in_process, threads
):
    assert serving_prefill_threads(cores, environ={}) == in_process
    assert serving_prefill_threads(cores, environ={}, engine_process=False) == threads


def test_omp_num_threads_decides_when_set():
    assert serving_cpu_threads(8, environ={"OMP_NUM_THREADS": "3"}) is None
    assert serving_prefill_threads(8, environ={"OMP_NUM_THREADS": "3"}) is None


def test_steps_switch_between_the_two_counts():
    assert step_thread_count(WIDE_STEP_TOKENS - 1, 1, 2) == 1
    assert step_thread_count(WIDE_STEP_TOKENS, 1, 2) == 2
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        threads = StepThreads(1, 2)
        seen = []
        for tokens in (3000, 2048, 16, 1, WIDE_STEP_TOKENS):
            threads.before_step(tokens)
            seen.append(torch.get_num_threads())
        assert seen == [2, 2, 1, 1, 2]
        torch.set_num_threads(1)
        unset = StepThreads(None, None)  # keeps torch's count for every step
        assert unset.prefill == unset.decode == 1
    finally:
        torch.set_num_threads(before)


def _run_wide_steps(chooser: WideStepThreads, steps: int, seconds_per_token) -> list[int]:
    chosen = []
    for _ in range(steps):
        count = chooser.choose()
        chosen.append(count)
        chooser.record(count, 512, 512 * seconds_per_token[count])
    return chosen


QUIET = {2: 6e-6, 1: 10e-6}  # seconds a prompt token: two threads 1.7x faster
CONTENDED = {2: 200e-6, 1: 10e-6}  # the other core busy: every parallel region waits


def _tries(chosen: list[int], of: int) -> list[int]:
    return [i for i, c in enumerate(chosen) if c == of]


def test_wide_steps_take_the_count_that_computes_faster():
    chosen = _run_wide_steps(WideStepThreads((2, 1)), 400, QUIET)
    assert chosen[:2] == [2, 1]  # each measured once
    # one thread, 1.7x slower, is tried again every 50 x 1.7 wide steps
    tries = _tries(chosen, 1)
    assert tries[0] == 1 and len(tries) == 5
    assert all(83 <= b - a <= 85 for a, b in itertools.pairwise(tries))
    # two threads, 20x slower, every 400 (the most it waits)
    chosen = _run_wide_steps(WideStepThreads((2, 1)), 800, CONTENDED)
    assert chosen[:2] == [2, 1] and _tries(chosen, 2) == [0, 401]


def test_wide_steps_follow_a_change_of_the_machines_load():
    chooser = WideStepThreads((2, 1))
    _run_wide_steps(chooser, 120, QUIET)
    contended = _run_wide_steps(chooser, 60, CONTENDED)
    # the count in use slows down: two slow steps and it is left (two threads come back
    # once: the try due while both counts measured about the same, which finds them slow)
    assert contended[:2] == [2, 2] and contended[2:].count(2) == 1
    quiet_again = _run_wide_steps(chooser, 600, QUIET)
    # two threads are tried again (the sooner, the less slower they were last seen), found
    # fast, and kept but for the tries of one thread
    back = quiet_again.index(2)
    assert back < 400
    assert len(_tries(quiet_again[back:], 1)) <= len(quiet_again[back:]) // 80 + 1


def test_one_slow_step_of_the_count_in_use_does_not_switch():
    chooser = WideStepThreads((2, 1))
    _run_wide_steps(chooser, 10, QUIET)
    chooser.record(2, 512, 512 * 200e-6)  # one outlier (another process's burst)
    chosen = _run_wide_steps(chooser, 60, QUIET)
    assert set(chosen) == {2}


@pytest.mark.parametrize(
    "content,cores",
    [("max 100000\n", None), ("200000 100000\n", 2), ("150000 100000\n", 2), ("5000 100000", 1)],
)
def test_cgroup_cpu_limit_in_whole_cores(tmp_path, content, cores):
    path = tmp_path / "cpu.max"
    path.write_text(content)
    assert cgroup_quota_cores(str(path)) == cores


def test_unreadable_cgroup_file_means_no_limit(tmp_path):
    assert cgroup_quota_cores(str(tmp_path / "absent")) is None
    (tmp_path / "bad").write_text("garbage")
    assert cgroup_quota_cores(str(tmp_path / "bad")) is None


def test_a_cgroup_limit_caps_the_usable_cores(tmp_path):
    path = tmp_path / "cpu.max"
    path.write_text("100000 100000\n")
    assert usable_cores(str(path)) == 1


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    return p.parse_args(["model-dir", *argv])


def test_serve_passes_the_policy_unless_cpu_threads_is_given(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert serve_cli.config_from_args(_args()).cpu_threads == max(1, usable_cores() - 1)
    assert serve_cli.config_from_args(_args("--cpu-threads", "3")).cpu_threads == 3


def test_serve_passes_the_prefill_policy_unless_a_count_is_given(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    prefill = lambda *argv: serve_cli.config_from_args(_args(*argv)).cpu_prefill_threads  # noqa: E731
    assert prefill() == usable_cores()
    assert prefill("--no-engine-process") == max(1, usable_cores() - 1)
    assert prefill("--cpu-threads", "3") == 3  # one count for every step
    assert prefill("--cpu-threads", "3", "--cpu-prefill-threads", "4") == 4


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def test_openmp_workers_spin_briefly_unless_the_user_chose():
    environ: dict[str, str] = {}
    assert quiet_openmp_spin(environ) and environ == {"GOMP_SPINCOUNT": OPENMP_SPIN_ROUNDS}
    for chosen in ({"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "300000"}):
        environ = dict(chosen)
        assert not quiet_openmp_spin(environ) and environ == chosen


def test_a_served_engine_runs_with_the_policys_threads(tiny_qwen3, tmp_path, monkeypatch):
    # SpawnedEngine pins OMP_NUM_THREADS=1 for tests; an explicit --cpu-threads wins over it,
    # and the engine says what it applied.
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    eng = SpawnedEngine(
        tiny_qwen3,
        tmp_path,
        "--cpu-threads",
        "2",
        "--cpu-prefill-threads",
        "3",
        "--log-level",
        "info",
    )
    try:
        eng.wait()
        cores = _children(eng.proc.pid)
        assert cores, "no engine core process under the server"
        environ = Path(f"/proc/{cores[0]}/environ").read_bytes().split(b"\0")
        assert f"GOMP_SPINCOUNT={OPENMP_SPIN_ROUNDS}".encode() in environ
    finally:
        eng.stop()
    line = next(x for x in eng.log.read_text().splitlines() if "engine ready" in x)
    assert re.search(r"\b2 threads \(up to 3 for steps of 256\+ tokens", line), line


@contextlib.contextmanager
def _engine_watching_steps(model, before_execute):
    """A real engine on one thread (two for wide steps) that calls `before_execute(out)` as
    each step starts; torch's thread count is restored after."""
    from pdpool.engine.config import EngineConfig
    from pdpool.engine.engine_core import LLMEngine

    before = torch.get_num_threads()
    try:
        engine = LLMEngine(
            EngineConfig(model=str(model), device="cpu", cpu_threads=1, cpu_prefill_threads=2)
        )
        execute = engine.runner.execute

        def watched(out):
            before_execute(out)
            return execute(out)

        engine.runner.execute = watched
        yield engine
    finally:
        torch.set_num_threads(before)


def test_an_engine_runs_prompt_steps_wide_and_decode_steps_narrow(tiny_qwen3):
    from pdpool.engine.sampling_params import SamplingParams

    seen = []
    record = lambda out: seen.append((out.num_scheduled_tokens, torch.get_num_threads()))  # noqa: E731
    with _engine_watching_steps(tiny_qwen3, record) as engine:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        engine.generate([list(range(3, 3 + WIDE_STEP_TOKENS + 40))], params)
    assert seen == [(WIDE_STEP_TOKENS + 40, 2), (1, 1), (1, 1)]


def test_an_engine_gives_up_wide_threads_that_compute_slower(tiny_qwen3):
    """Two threads made slow (as when another process holds the second core): after one
    wide step on each count, the engine's prompt steps run on one thread."""
    from pdpool.engine.sampling_params import SamplingParams

    wide = []

    def contended(out):
        threads = torch.get_num_threads()
        if out.num_scheduled_tokens >= WIDE_STEP_TOKENS:
            wide.append(threads)
        if threads == 2:
            time.sleep(0.05)

    with _engine_watching_steps(tiny_qwen3, contended) as engine:
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for i in range(6):  # one prompt at a time: one wide step each
            engine.generate([list(range(3 + i, 3 + i + WIDE_STEP_TOKENS + 40))], params)
    assert wide == [2, 1, 1, 1, 1, 1]
