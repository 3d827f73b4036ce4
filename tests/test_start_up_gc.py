"""A server's start-up objects are frozen: later full collections walk only what came after
(an engine's ~240k start-up objects made each full collection a 100 ms stall of every
stream)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import gc, json
import pdpool.engine.engine_core  # torch, transformers: what an engine process holds
from pdpool.start_up_gc import freeze_start_up_objects
before = len(gc.get_objects())
freeze_start_up_objects()
after, frozen = len(gc.get_objects()), gc.get_freeze_count()
print(json.dumps({"before": before, "after": after, "frozen": frozen}))
"""


def test_an_engines_start_up_objects_leave_the_collectors_reach():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["before"] > 50_000  # the probe imported what an engine imports
    assert counts["frozen"] > 0.9 * counts["before"]
    assert counts["after"] < 0.01 * counts["before"]
