"""glibc's malloc settings for one process; nothing happens under another C library.

The engine core keeps freed blocks for its next step (engine/cpu_memory.py). A server that
relays requests wants the opposite after a large body: glibc raises its mmap threshold each
time it frees a mapped block (up to 32 MiB), so after a few large bodies the next ones come
from its heaps and arenas, which keep what is freed. A gateway that had read eight 30 MB
bodies stayed at 170-260 MiB. With the threshold fixed, blocks of a MiB or more are mapped
on their own and unmapped when freed, and it went back to 74-88 MiB; smaller blocks, every
ordinary request's, are served as before.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Optional

# mallopt's parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# What a relaying server maps on its own (and unmaps when freed).
OWN_MAPPING_BYTES = 1 << 20
# Setting the mmap threshold ends glibc's raising of its trim threshold too, which would
# stay at 128 KiB: the heap's top would be given back and taken again as requests come and
# go. This much of it stays (what smaller blocks need; larger ones are mapped).
KEPT_TOP_BYTES = 16 << 20


def glibc() -> Optional[ctypes.CDLL]:
    """The process's C library when it is glibc; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    # the process's own symbols, its C library's among them (ctypes.util.find_library would
    # run ldconfig in a subprocess)
    libc = ctypes.CDLL(None)
    # musl and others have no mallopt, or one that ignores these parameters
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return None
    return libc


def mallopt(libc: ctypes.CDLL, settings: tuple[tuple[int, int], ...]) -> bool:
    """Applies every (parameter, value); True when glibc took them all."""
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return all([libc.mallopt(param, value) for param, value in settings])


def unmap_large_frees(libc: Optional[ctypes.CDLL] = None) -> bool:
    """Fixes the mmap threshold at OWN_MAPPING_BYTES (and the trim threshold at
    KEPT_TOP_BYTES); False where that is not glibc's."""
    libc = libc if libc is not None else glibc()
    settings = ((M_MMAP_THRESHOLD, OWN_MAPPING_BYTES), (M_TRIM_THRESHOLD, KEPT_TOP_BYTES))
    return libc is not None and mallopt(libc, settings)
