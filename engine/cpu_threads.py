"""How many torch threads `pdpool serve` gives the model on CPU when --cpu-threads is not set.

The HTTP server (event loop, SSE chunks, detokenized text handed back) runs in the same
process as the engine thread. With as many OpenMP threads as cores, every parallel region
of the model waits for a worker that the server thread has just taken the core from, and a
small model's step becomes a queue of such waits. So the model gets every usable core but
one, and the server keeps that one: as vLLM on CPU, which reserves a core per engine for
its frontend and scheduler process. --cpu-threads, or else OMP_NUM_THREADS, overrides it.
"""

from __future__ import annotations

import math
import os
from typing import Optional

CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def usable_cores(cgroup_cpu_max: str = CGROUP_CPU_MAX) -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota
    (a Kubernetes CPU limit) rounded up."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    quota = cgroup_quota_cores(cgroup_cpu_max)
    if quota is not None:
        cores = min(cores, quota)
    return max(1, cores)


def cgroup_quota_cores(path: str = CGROUP_CPU_MAX) -> Optional[int]:
    """The cgroup v2 CPU limit in whole cores (rounded up), None when there is none."""
    try:
        with open(path) as fh:
            quota, period = fh.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def serving_cpu_threads(cores: Optional[int] = None, environ=os.environ) -> Optional[int]:
    """Torch threads for a CPU engine behind its own HTTP server: all cores but one; None
    (torch's default) when OMP_NUM_THREADS is set, which then decides."""
    if environ.get("OMP_NUM_THREADS"):
        return None
    cores = usable_cores() if cores is None else cores
    return max(1, cores - 1)
