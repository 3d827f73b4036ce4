"""keep_freed_memory: a step's freed activations are used again, not mapped afresh."""

from __future__ import annotations

import textwrap

import pytest

from pdpool.engine.cpu_memory import keep_freed_memory
from pdpool.glibc_malloc import glibc
from tests.support.python_child import printed_by


# Steps of mixed block sizes, as a prompt step's activations, on a thread: the page faults of
# ten steps after a first one.
STEPS = textwrap.dedent(
    """
    import ctypes, ctypes.util, resource, sys, threading
    from pdpool.engine.cpu_memory import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    sizes = [n << 20 for n in (4, 16, 8, 12, 16, 4) * 2]
    def step():
        blocks = [libc.malloc(n) for n in sizes]
        for b, n in zip(blocks, sizes):
            ctypes.memset(b, 1, n)
        for b in blocks:
            libc.free(b)
    def steps():
        step()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            step()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    # on a thread, as the engine's steps run
    worker = threading.Thread(target=steps)
    worker.start()
    worker.join()
    """
)


def faults_of_ten_steps(mode: str) -> int:
    return int(printed_by(STEPS, mode))


@pytest.mark.skipif(glibc() is None, reason="the thresholds are glibc's")
def test_freed_activation_blocks_are_used_again_without_page_faults():
    untouched = faults_of_ten_steps("default")
    kept = faults_of_ten_steps("keep")
    # 120 MiB a step: more than one of glibc's thread heaps holds (64 MiB), which it maps
    # afresh each time
    assert untouched > 10 * 1024, untouched
    assert kept < untouched / 20, (kept, untouched)


class RefusingLibc:
    """A C library whose mallopt refuses every setting (returns 0, as glibc does for a value
    out of range)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

        def mallopt(param: int, value: int) -> int:
            self.calls.append((param, value))
            return 0

        self.mallopt = mallopt


def test_a_refused_setting_is_reported_not_raised(caplog):
    libc = RefusingLibc()
    with caplog.at_level("WARNING"):
        assert keep_freed_memory(libc) is False  # type: ignore[arg-type]
    assert libc.calls and "mallopt refused" in caplog.text
