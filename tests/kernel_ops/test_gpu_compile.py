"""Every kernel configuration the launchers produce compiles to a cubin for Hopper (sm_90).

The interpreter runs kernels with Python semantics, so this is what catches code that only
the GPU compiler rejects, on a machine without a GPU (Triton bundles ptxas).
"""

import json
import os
import subprocess
import sys


def test_all_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run(
        [sys.executable, "-m", "pdpool.kernels.compile_check", "--arch", "90", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.stdout.strip(), result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    failures = [r for r in report if not r["ok"]]
    assert not failures, failures
    kernels = {r["kernel"].split(":")[0] for r in report}
    assert kernels == {
        "paged_attention",
        "merge_splits",
        "write_kv",
        "conv1d_update",
        "gated_delta_decode",
    }
    assert result.returncode == 0
