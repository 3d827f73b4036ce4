"""How many torch threads `pdpool serve` gives the model on CPU when --cpu-threads is not set.

The HTTP server (event loop, SSE chunks, detokenized text handed back) runs in the same
process as the engine thread. With as many OpenMP threads as cores, every parallel region
of the model waits for a worker that the server thread has just taken the core from, and a
small model's step becomes a queue of such waits. So the model gets every usable core but
one, and the server keeps that one: as vLLM on CPU, which reserves a core per engine for
its frontend and scheduler process. --cpu-threads, or else OMP_NUM_THREADS, overrides it.

A step that computes many prompt tokens is different: its matmuls are large enough to split
over every core, and while it runs the server (in its own process by default) has little
to do. Such steps get every core (`serving_prefill_threads`); `StepThreads` switches torch
between the two counts as the steps come. --cpu-prefill-threads overrides it.

Whether every core is in fact faster is measured, not assumed: when other processes keep the
other cores busy (the server relaying many streams, `pdpool up`'s sidecar and gateway, other
jobs), each parallel region of a many-thread step waits for a core one of them holds: with
40 streams in the batch beside `pdpool up`'s other processes on 2 cores, two threads took
56 us a prompt token and one 16, and every stream's next token waits for such a step. So
`WideStepThreads` gives wide steps whichever of the two counts has computed a prompt token
faster lately, and tries the other one now and then.

Between two parallel regions GNU OpenMP's idle workers spin (300000 rounds by default,
milliseconds) before they sleep. A spinning worker takes a core from whatever runs next:
the attention kernels' own threads, the server. `pdpool serve` shortens the spin
(`quiet_openmp_spin`) unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set: long-prompt steps
measured 6-9% faster in-process, with less CPU time.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from pdpool.cpu_cores import usable_cores

log = logging.getLogger(__name__)


def serving_cpu_threads(cores: Optional[int] = None, environ=os.environ) -> Optional[int]:
    """Torch threads for a CPU engine behind its own HTTP server: all cores but one; None
    (torch's default) when OMP_NUM_THREADS is set, which then decides."""
    if environ.get("OMP_NUM_THREADS"):
        return None
    cores = usable_cores() if cores is None else cores
    return max(1, cores - 1)


def serving_prefill_threads(
    cores: Optional[int] = None, environ=os.environ, engine_process: bool = True
) -> Optional[int]:
    """Torch threads for a step with many tokens to compute (prompt chunks): every core when
    the engine runs in a process of its own, whose server process idles through such a
    step; the decode count otherwise. None when OMP_NUM_THREADS is set."""
    if not engine_process:
        return serving_cpu_threads(cores, environ)
    if environ.get("OMP_NUM_THREADS"):
        return None
    return usable_cores() if cores is None else cores


# Spin rounds of an idle OpenMP worker before it sleeps: ~0.1-0.3 ms, enough to catch the
# next region of the same layer without holding a core through a kernel call.
OPENMP_SPIN_ROUNDS = "20000"


def quiet_openmp_spin(environ=os.environ) -> bool:
    """Sets GOMP_SPINCOUNT for the engine processes this one starts (the OpenMP runtime
    reads it when torch loads), unless the user set a wait policy. True if it set it."""
    if environ.get("OMP_WAIT_POLICY") or environ.get("GOMP_SPINCOUNT"):
        return False
    environ["GOMP_SPINCOUNT"] = OPENMP_SPIN_ROUNDS
    return True


# The CPU engine core's niceness. Its steps keep a core busy without pause, and every token
# it makes reaches the client through processes on the same cores (the server, and under
# `pdpool up` the sidecar and gateway): at default priority each of them, woken by a token
# or a new request, waited for the core's slice to end. A lower priority lets them take the
# core as soon as they have work (they need little of it), and is only weighed against
# processes in the same scheduling group (the pod's cgroup, the session's autogroup). 40
# tiny-model streams through `pdpool up` beside a quiet tenant, no tenants file
# (benchmarks/flow_control.py): the quiet tenant's TTFT p99 159-257 ms -> 80-101 ms, and
# 5400-5958 -> 6290-6417 tokens/s.
CORE_NICE = 10


def yield_to_relays() -> int:
    """Lowers this process's CPU priority to CORE_NICE (never raises it; a user's higher
    niceness stays): call it on the main thread before other threads start, which inherit
    it. Returns the niceness now."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current < CORE_NICE:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, CORE_NICE)
        except OSError as exc:  # a seccomp profile may refuse it: the engine still serves
            log.warning("the engine core keeps its priority: %s", exc)
    return os.getpriority(os.PRIO_PROCESS, 0)


# A step computing at least this many tokens runs on the prefill thread count: its matmuls
# have rows enough to split (at 256 tokens a layer's projections are ~100 M multiply-adds,
# milliseconds on one core, where a parallel region costs microseconds). Smaller steps are
# decodes, whose matmuls are too small to share and whose threads would wait on the
# server's process for a core.
WIDE_STEP_TOKENS = 256


def step_thread_count(tokens: int, decode: int, prefill: int) -> int:
    """The thread count for a step that computes `tokens` tokens."""
    return prefill if tokens >= WIDE_STEP_TOKENS else decode


# Wide steps between two tries of the count not in use, times how much slower it measured
# (at most 8x): a count far slower (threads waiting for busy cores) is retried every 400 wide
# steps, since each try stalls every stream once; one 1.7x slower every 85.
EXPLORE_EVERY = 50
EXPLORE_SCALE_CAP = 8.0
COST_SMOOTHING = 0.3
SAMPLE_CLIP = 2.0


class WideStepThreads:
    """Chooses a wide step's thread count among `counts`: the one with the lowest recent
    seconds per computed token. Now and then (`explore_interval`) the other one, whose cost
    is then replaced by what it measures (an old figure says nothing of the machine now)."""

    def __init__(self, counts: tuple[int, ...]) -> None:
        self.cost: dict[int, Optional[float]] = dict.fromkeys(counts)
        self.wide_steps = 0
        self.last_try = 0
        self.exploring: Optional[int] = None
        self.in_use = counts[0]

    def explore_interval(self, best: int, other: int) -> float:
        ratio = (self.cost[other] or 0.0) / max(self.cost[best] or 0.0, 1e-12)
        return EXPLORE_EVERY * min(max(ratio, 1.0), EXPLORE_SCALE_CAP)

    def choose(self) -> int:
        self.wide_steps += 1
        self.exploring = None
        for count, cost in self.cost.items():
            if cost is None:
                self.exploring = count
                self.last_try = self.wide_steps
                return count
        best = min(self.cost, key=lambda c: self.cost[c] or 0.0)
        other = next(c for c in self.cost if c != best)
        if best != self.in_use:
            log.info(
                "prompt steps now on %d threads: %.2f us a token, against %.2f on %d",
                best,
                (self.cost[best] or 0.0) * 1e6,
                (self.cost[other] or 0.0) * 1e6,
                other,
            )
            self.in_use = best
        if self.wide_steps - self.last_try >= self.explore_interval(best, other):
            self.exploring = other
            self.last_try = self.wide_steps
            return other
        return best

    def record(self, count: int, tokens: int, seconds: float) -> None:
        per_token = seconds / max(1, tokens)
        old = self.cost.get(count)
        if old is None or count == self.exploring:
            self.cost[count] = per_token
            return
        # One sample moves the figure at most 2x (then smoothed): a lone outlier (another
        # process's burst) does not switch counts; two slow steps in a row do.
        per_token = min(max(per_token, old / SAMPLE_CLIP), old * SAMPLE_CLIP)
        self.cost[count] = old + COST_SMOOTHING * (per_token - old)


class StepThreads:
    """Sets torch's thread count before each step (only when it changes: a change costs a
    few microseconds, a step milliseconds). Wide steps get the prefill count or the decode
    count, whichever `WideStepThreads` finds faster."""

    def __init__(self, decode: Optional[int], prefill: Optional[int]) -> None:
        self.decode = decode or torch_threads()
        self.prefill = prefill or self.decode
        self.current = torch_threads()
        self.wide: Optional[WideStepThreads] = None
        if self.prefill != self.decode:
            self.wide = WideStepThreads((self.prefill, self.decode))
        self.step_count: Optional[int] = None  # the wide step's count, for after_step
        from pdpool.kernels import cpu_parallel

        cpu_parallel.allow_big_calls(self.prefill)

    def describe(self) -> str:
        if self.prefill == self.decode:
            return f"{self.decode} threads"
        return (
            f"{self.decode} threads (up to {self.prefill} for steps of {WIDE_STEP_TOKENS}+ "
            "tokens, where measured faster)"
        )

    def before_step(self, tokens: int) -> None:
        wanted = step_thread_count(tokens, self.decode, self.prefill)
        self.step_count = None
        if wanted != self.decode and self.wide is not None:
            wanted = self.step_count = self.wide.choose()
        if wanted != self.current:
            set_torch_threads(wanted)
            self.current = wanted

    def after_step(self, tokens: int, seconds: float) -> None:
        if self.step_count is not None and self.wide is not None:
            self.wide.record(self.step_count, tokens, seconds)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def set_torch_threads(count: int) -> None:
    import torch

    torch.set_num_threads(count)
