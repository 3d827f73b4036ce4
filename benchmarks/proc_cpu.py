"""CPU time from Linux's /proc/<pid>/stat (and /proc/self/task/<tid>/stat), for the
benchmarks that report CPU per request or per token."""

from __future__ import annotations

import os
from typing import Optional

CLK_TCK = os.sysconf("SC_CLK_TCK")


def stat_fields(path: str) -> Optional[list[str]]:
    """A stat file's fields after the command name (state first, so pgrp is [2], utime
    [11], stime [12]); None when the process or thread has gone."""
    try:
        with open(path) as fh:
            # The command name may hold spaces and parentheses: split after its last ")".
            return fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def fields_cpu_seconds(fields: list[str]) -> float:
    """User + system CPU seconds of a stat line's fields."""
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_seconds_of(path: str) -> float:
    """User + system CPU seconds of one process or thread; 0 when it has gone."""
    fields = stat_fields(path)
    return fields_cpu_seconds(fields) if fields is not None else 0.0
