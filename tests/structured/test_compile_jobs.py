"""GrammarJobs (engine/structured/compile_jobs.py): compiles off the caller's thread, each
within a deadline, bounded in slots and in compiles that run on past their deadline. A
compile function that waits on an event stands in for a slow xgrammar compile; everything
else is the real class, on real threads."""

from __future__ import annotations

import queue
import threading

import pytest

from pdpool.engine.outputs import EngineBusy
from pdpool.engine.structured.compile_jobs import CompileBounds, GrammarJobs
from pdpool.engine.structured.grammar import GuidedDecodingError
from pdpool.engine.structured.spec import GuidedSpec


class SlowCompiler:
    """compile(spec) returns "compiled:<value>" once `release(value)` is called."""

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}
        self.started: "queue.Queue[str]" = queue.Queue()

    def gate(self, value: str) -> threading.Event:
        return self.gates.setdefault(value, threading.Event())

    def __call__(self, spec: GuidedSpec) -> str:
        self.started.put(spec.value)
        self.gate(spec.value).wait(30)
        if spec.value.startswith("bad"):
            raise GuidedDecodingError("cannot compile")
        return f"compiled:{spec.value}"


class Answers:
    def __init__(self) -> None:
        self.q: "queue.Queue[tuple[str, object]]" = queue.Queue()

    def submit(self, jobs: GrammarJobs, rid: str, value: str) -> None:
        jobs.submit(
            rid,
            GuidedSpec("regex", value),
            lambda compiled: self.q.put((rid, compiled)),
            lambda exc: self.q.put((rid, exc)),
        )

    def next(self, timeout: float = 10) -> tuple[str, object]:
        return self.q.get(timeout=timeout)


def spec_jobs(**bounds) -> tuple[SlowCompiler, GrammarJobs, Answers]:
    compiler = SlowCompiler()
    return compiler, GrammarJobs(compiler, CompileBounds(**bounds)), Answers()


def test_a_compile_answers_ready_or_refused_with_the_compilers_reason():
    compiler, jobs, answers = spec_jobs(timeout_s=10)
    compiler.gate("a").set()
    compiler.gate("bad").set()
    answers.submit(jobs, "r1", "a")
    assert answers.next() == ("r1", "compiled:a")
    answers.submit(jobs, "r2", "bad")
    rid, exc = answers.next()
    assert rid == "r2" and isinstance(exc, GuidedDecodingError)


def test_a_compile_past_its_deadline_is_refused_then_and_frees_its_slot():
    compiler, jobs, answers = spec_jobs(timeout_s=0.3, slots=1, max_overrun=2)
    answers.submit(jobs, "slow", "slow")
    rid, exc = answers.next()
    assert rid == "slow" and isinstance(exc, GuidedDecodingError)
    assert "did not compile within 0.3s" in str(exc)
    # Its slot is free: the next request compiles although the slow one still runs.
    compiler.gate("quick").set()
    answers.submit(jobs, "quick", "quick")
    assert answers.next() == ("quick", "compiled:quick")
    compiler.gate("slow").set()  # the overrun ends unattended: no second answer
    with pytest.raises(queue.Empty):
        answers.next(timeout=0.3)


def test_at_the_overrun_cap_guided_requests_get_busy_until_one_ends():
    compiler, jobs, answers = spec_jobs(timeout_s=0.2, slots=2, max_overrun=1)
    answers.submit(jobs, "slow", "slow")
    assert isinstance(answers.next()[1], GuidedDecodingError)
    assert jobs.holdup_s() > 0
    answers.submit(jobs, "next", "next")
    rid, exc = answers.next()
    assert rid == "next" and isinstance(exc, EngineBusy)
    compiler.gate("slow").set()
    for _ in range(100):
        if jobs.holdup_s() == 0:
            break
        threading.Event().wait(0.02)
    assert jobs.holdup_s() == 0
    compiler.gate("next").set()
    answers.submit(jobs, "next", "next")
    assert answers.next() == ("next", "compiled:next")


def test_a_queued_request_waits_for_a_slot_and_is_busy_if_none_frees():
    compiler, jobs, answers = spec_jobs(timeout_s=5, slots=1, max_overrun=1)
    answers.submit(jobs, "first", "first")
    assert compiler.started.get(timeout=5) == "first"
    answers.submit(jobs, "second", "second")
    compiler.gate("second").set()
    compiler.gate("first").set()  # the slot frees: the queued one starts and is answered
    assert {answers.next(), answers.next()} == {
        ("first", "compiled:first"),
        ("second", "compiled:second"),
    }
    _, jobs2, answers2 = spec_jobs(timeout_s=0.3, slots=1, max_overrun=5)
    answers2.submit(jobs2, "a", "a")
    answers2.submit(jobs2, "b", "b")
    got = dict([answers2.next(), answers2.next()])
    assert isinstance(got["a"], GuidedDecodingError)  # it ran out of time compiling
    assert isinstance(got["b"], EngineBusy)  # it never had a slot: not its own fault


def test_a_cancelled_request_gets_no_answer_and_gives_its_slot_up():
    compiler, jobs, answers = spec_jobs(timeout_s=10, slots=1, max_overrun=2)
    answers.submit(jobs, "gone", "gone")
    assert compiler.started.get(timeout=5) == "gone"
    jobs.cancel("gone")
    compiler.gate("other").set()
    answers.submit(jobs, "other", "other")
    assert answers.next() == ("other", "compiled:other")
    compiler.gate("gone").set()
    with pytest.raises(queue.Empty):
        answers.next(timeout=0.3)


def test_a_full_queue_is_busy_at_once():
    compiler, jobs, answers = spec_jobs(timeout_s=10, slots=1, max_queued=1)
    answers.submit(jobs, "running", "running")
    assert compiler.started.get(timeout=5) == "running"
    answers.submit(jobs, "queued", "queued")
    answers.submit(jobs, "refused", "refused")
    rid, exc = answers.next(timeout=1)
    assert rid == "refused" and isinstance(exc, EngineBusy)
    for value in ("running", "queued"):
        compiler.gate(value).set()
