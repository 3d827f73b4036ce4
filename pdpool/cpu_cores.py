"""How many cores this process may use, and a fair share of them: read by the engine's thread
policy (engine/cpu_threads.py) and by `pdpool up`, which runs several engines on one
machine."""

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


def engine_share_of_cores(
    engines: int, cores: Optional[int] = None, environ=os.environ
) -> Optional[int]:
    """Threads for each of `engines` engines sharing this machine's cores (as `pdpool up`
    runs them): an equal share, at least one; None when OMP_NUM_THREADS is set."""
    if environ.get("OMP_NUM_THREADS"):
        return None
    cores = usable_cores() if cores is None else cores
    return max(1, cores // max(1, engines))
