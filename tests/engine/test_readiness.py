"""Readiness of the async engine loop (what `/ready` answers): a loop that stops ticking
while it has work, or a dead engine thread, is not ready; an idle loop is."""

from __future__ import annotations

import threading
import time

import pytest

from pdpool.engine.core_client import InProcessClient


class NoCompiles:
    """Grammar compile jobs that never hold up admission."""

    def holdup_s(self) -> float:
        return 0.0


class SteppableEngine:
    """Just what InProcessClient drives; `step` blocks while `gate` is closed."""

    def __init__(self) -> None:
        self.work = False
        self.gate = threading.Event()
        self.gate.set()
        self.die = False
        self.requests: dict = {}
        self.last_step_idle = False
        self.grammar_jobs = NoCompiles()

    def has_unfinished(self) -> bool:
        return self.work

    def idle_tick(self) -> None:
        pass

    def step(self):
        if self.die:
            raise SystemExit  # ends the engine thread, as a crash outside the guard would
        self.gate.wait()
        return []

    def abort_request(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_idle_loop_is_ready_a_wedged_step_is_not_and_recovers():
    eng = SteppableEngine()
    aeng = InProcessClient(eng)
    try:
        time.sleep(0.4)
        assert aeng.readiness(max_stall_s=0.2) is None  # idle for long: still ready
        eng.gate.clear()
        eng.work = True  # a step that hangs
        assert wait_for(lambda: aeng.readiness(0.2) is not None)
        assert "not ticked" in aeng.readiness(0.2)
        assert aeng.alive  # liveness is unaffected
        eng.gate.set()  # the step returns
        assert wait_for(lambda: aeng.readiness(0.2) is None)
        eng.work = False
    finally:
        eng.gate.set()
        aeng.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_engine_thread_is_not_ready():
    eng = SteppableEngine()
    aeng = InProcessClient(eng)
    eng.die, eng.work = True, True
    assert wait_for(lambda: not aeng.alive)
    assert aeng.readiness(max_stall_s=60) == "the engine loop has stopped"
