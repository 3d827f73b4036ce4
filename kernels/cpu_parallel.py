"""Run a CPU kernel's independent parts on several threads at once.

The kernels are C functions called through ctypes, which releases the GIL for the call: the
parts of one kernel call, each given to its own Python thread, run on as many cores. The
threads are kept between calls (a step calls the kernels once per layer), and the calling
thread runs the first part itself instead of waiting idle.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Optional

import torch

_pool: Optional[ThreadPoolExecutor] = None
_pool_workers = 0
_pool_lock = threading.Lock()


_threads_for_big_calls = 1


def allow_big_calls(threads: int) -> None:
    """Lets a call with a lot of work use up to `threads` threads even in a step that runs
    torch on fewer (the engine passes the count its prompt steps use)."""
    global _threads_for_big_calls
    _threads_for_big_calls = max(1, threads)


def kernel_threads(big: bool = False) -> int:
    """How many threads a kernel call may use: as many as torch's own ops use, or for a
    `big` call, what `allow_big_calls` allowed if that is more."""
    threads = max(1, torch.get_num_threads())
    return max(threads, _threads_for_big_calls) if big else threads


def _workers(count: int) -> ThreadPoolExecutor:
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None or _pool_workers < count:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="pdpool-kernel")
            _pool_workers = count
        return _pool


def run_parts(run_part: Callable[[int], None], parts: int) -> None:
    """`run_part(i)` for every i in [0, parts), at once. Returns only when every part is
    done (they write into buffers the caller owns), then raises a part's error, if any."""
    if parts <= 1:
        run_part(0)
        return
    pool = _workers(parts - 1)
    others = [pool.submit(run_part, i) for i in range(1, parts)]
    try:
        run_part(0)
    finally:
        wait(others)
    for other in others:
        other.result()
