"""unmap_large_frees: what large blocks a relaying server freed goes back to the kernel."""

from __future__ import annotations

import textwrap

import pytest

from pdpool.glibc_malloc import glibc
from tests.support.python_child import printed_by


# Four threads (as bodies parsed off the event loop) each take and free 8 MiB blocks, with a
# small block that stays allocated after each round: the MiB still resident afterwards.
ROUNDS = textwrap.dedent(
    """
    import ctypes, sys, threading
    from pdpool.glibc_malloc import unmap_large_frees
    if sys.argv[1] == "unmap":
        assert unmap_large_frees()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    def rss():
        with open("/proc/self/status") as f:
            return int([ln for ln in f if ln.startswith("VmRSS")][0].split()[1]) // 1024
    base, kept = rss(), []
    def bodies():
        for _ in range(3):
            big = [libc.malloc(8 << 20) for _ in range(4)]
            for b in big:
                ctypes.memset(b, 1, 8 << 20)
            kept.append(libc.malloc(1000))
            for b in big:
                libc.free(b)
    threads = [threading.Thread(target=bodies) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(rss() - base)
    """
)


def resident_after(mode: str) -> int:
    return int(printed_by(ROUNDS, mode))


@pytest.mark.skipif(glibc() is None, reason="the threshold is glibc's")
def test_large_blocks_freed_on_threads_are_unmapped():
    kept = resident_after("default")
    given_back = resident_after("unmap")
    assert kept >= 64, kept  # glibc's raised threshold keeps them in its heaps
    assert given_back <= 8, given_back
