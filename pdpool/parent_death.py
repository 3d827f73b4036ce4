"""Children that end when the process that started them ends, however it ends.

`pdpool up` starts its engines, sidecars and gateway in sessions of their own (a Ctrl-C in
the terminal reaches only `up`, which then stops them in order). If `up` itself is killed
(SIGKILL, the OOM killer, a crash), nothing would stop them: they would keep their ports,
memory and GPU. On Linux each child is started through `run`, which asks the kernel to send
it SIGTERM when its parent ends and then executes the real command (the request survives
exec, so it covers third-party programs too: Envoy, stock vLLM).

The kernel's notion of parent is the thread that forked: the caller must start the
children from a thread that lives as long as they should (`pdpool up` uses its main
thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import NoReturn

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def supported() -> bool:
    return sys.platform.startswith("linux")


def wrapped(argv: list[str], parent_pid: int) -> list[str]:
    """`argv`, to be run so that it ends with `parent_pid` (unchanged where unsupported)."""
    if not supported():
        return list(argv)
    return [
        sys.executable,
        "-c",
        "from pdpool.parent_death import run; run()",
        str(parent_pid),
        *argv,
    ]


def end_with(parent: int, sig: int) -> bool:
    """Asks the kernel for `sig` when this process's parent ends; False when that cannot
    be asked or the parent (pid `parent`) has already ended, so that no signal will come."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    return os.getppid() == parent


def run() -> NoReturn:
    """The trampoline: `python -c ... PARENT_PID COMMAND [ARG...]`."""
    parent, argv = int(sys.argv[1]), sys.argv[2:]
    if not end_with(parent, signal.SIGTERM):
        print("pdpool: its parent has ended (or cannot be followed); not started", file=sys.stderr)
        sys.exit(1)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"pdpool: cannot run {argv[0]}: {exc}", file=sys.stderr)
        sys.exit(127)
