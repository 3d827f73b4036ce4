"""`pdpool up --autoscale` flags that cannot describe a planner: a non-zero exit with one
line of why, before any process starts."""

from __future__ import annotations

import subprocess

import pytest

from pdpool.up.topology import pdpool_command

# Starts engine processes: the full run's tier, not the fast one.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prefill", "0", "--prefill-max", "2"], "scale-to-zero"),
        (["--decode", "2", "--decode-max", "1"], "need 0 <= min <= max"),
        (["--itl-target-ms", "0"], "--itl-target-ms must be in (0,"),
        (["--kv-events"], "--autoscale with --kv-events is not supported"),
        (["--autoscale-interval-s", "0"], "--autoscale-interval-s must be in (0,"),
        (["--autoscale-trace", "/no-such-dir/t.jsonl.gz"], "No such file or directory"),
    ],
)
def test_bad_autoscale_flags_exit_with_a_reason(flags, message, tmp_path):
    done = subprocess.run(
        pdpool_command("up", "--autoscale", "--model", str(tmp_path), *flags),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_trace_without_autoscale_is_refused(tmp_path):
    done = subprocess.run(
        pdpool_command("up", "--model", str(tmp_path), "--autoscale-trace", str(tmp_path / "t")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "--autoscale-trace records the planner's inputs: it needs --autoscale" in done.stderr
    assert not (tmp_path / "t").exists()
