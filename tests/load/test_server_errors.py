"""What a failed load test shows of its servers' logs: each server failure with its
traceback, named by its log, and nothing of the ordinary lines around it."""

from __future__ import annotations

from devtools.load_targets import server_errors

LOG = """INFO:     Started server process [1]
ERROR:    Exception in ASGI application
Traceback (most recent call last):
  File "app.py", line 3, in __call__
    route()

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "flows.py", line 9, in run
KeyError: 'choices'
INFO:     127.0.0.1:5 - "POST /v1/completions HTTP/1.1" 200
ERROR:    ASGI callable returned without starting response.
INFO:     127.0.0.1:6 - "POST /v1/completions HTTP/1.1" 500
"""


def test_each_failure_with_its_traceback_and_nothing_else(tmp_path):
    (tmp_path / "sidecar-0.log").write_text(LOG)
    (tmp_path / "decode-0.log").write_text("INFO:     Application startup complete.\n")
    lines = server_errors(sorted(tmp_path.glob("*.log"))).splitlines()
    assert lines[0] == "sidecar-0: ERROR:    Exception in ASGI application"
    assert lines[-2] == "sidecar-0: KeyError: 'choices'"
    assert lines[-1] == "sidecar-0: ERROR:    ASGI callable returned without starting response."
    assert not any("INFO" in line or line.startswith("decode-0") for line in lines)


def test_none_is_empty_and_many_are_cut(tmp_path):
    (tmp_path / "gateway-0.log").write_text("INFO: ready\n")
    assert server_errors([tmp_path / "gateway-0.log", tmp_path / "missing.log"]) == ""
    (tmp_path / "gateway-0.log").write_text(LOG * 20)
    out = server_errors([tmp_path / "gateway-0.log"], limit=10).splitlines()
    assert len(out) == 11 and out[-1].startswith("... ") and out[-1].endswith("lines more")
