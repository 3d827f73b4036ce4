"""Runs a short Python program in a fresh interpreter (process-wide state such as malloc's
settings must not leak into the test process) and returns what it printed."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def printed_by(code: str, *args: str, timeout: float = 120) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=True,
    )
    return done.stdout.strip()
