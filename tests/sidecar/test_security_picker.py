"""SSRF allowlist for x-prefiller-host-port, and load-based picking of prefill engines."""

import pytest

from pdpool.sidecar.routing.picker import LoadPicker
from pdpool.sidecar.net.security import (
    ForbiddenTarget,
    allowed_target,
    allowed_targets,
    normalize_host_port,
)

ALLOWED = ["10.0.0.5:8000", "http://prefill-1.ns.svc:8000/"]


@pytest.mark.parametrize(
    "value,expected",
    [
        ("10.0.0.5:8000", "10.0.0.5:8000"),
        ("http://10.0.0.5:8000", "10.0.0.5:8000"),
        ("PREFILL-1.ns.svc:8000", "prefill-1.ns.svc:8000"),
        (None, None),
        ("  ", None),
    ],
)
def test_allowed(value, expected):
    assert allowed_target(value, ALLOWED) == expected


@pytest.mark.parametrize(
    "value",
    [
        "10.0.0.5:8001",  # known host, other port (e.g. the decode engine)
        "169.254.169.254:80",  # cloud metadata
        "10.0.0.5",  # no port
        "http://10.0.0.5:8000/admin",  # a path
        "user@10.0.0.5:8000",
        "10.0.0.5:99999",
        "10.0.0.5:abc",
        ":8000",
    ],
)
def test_forbidden(value):
    with pytest.raises(ForbiddenTarget):
        allowed_target(value, ALLOWED)


def test_comma_separated_list_as_llm_d():
    assert allowed_targets("10.0.0.5:8000, prefill-1.ns.svc:8000,10.0.0.5:8000", ALLOWED) == [
        "10.0.0.5:8000",
        "prefill-1.ns.svc:8000",
    ]
    assert allowed_target("prefill-1.ns.svc:8000,10.0.0.5:8000", ALLOWED) == "prefill-1.ns.svc:8000"
    assert allowed_targets(None, ALLOWED) == [] and allowed_targets(" ", ALLOWED) == []
    for bad in (
        "10.0.0.5:8000,10.0.0.5:8001",
        "10.0.0.5:8000,",
        ",10.0.0.5:8000",
        "10.0.0.5:8000,169.254.169.254:80",
        ",".join(["10.0.0.5:8000"] * 65),
    ):
        with pytest.raises(ForbiddenTarget):
            allowed_targets(bad, ALLOWED)


def test_ipv6_normalization():
    assert normalize_host_port("[FD00::1]:8000") == "[fd00::1]:8000"


def test_picker_prefers_least_loaded_and_keeps_others_as_retries():
    picker = LoadPicker()
    pool = ["a:1", "b:1", "c:1"]
    with picker.track("a:1"), picker.track("a:1"), picker.track("b:1"):
        order = picker.order(pool)
        assert order == ["c:1", "b:1", "a:1"]
        assert picker.in_flight("a:1") == 2
    assert picker.in_flight("a:1") == 0


def test_picker_spreads_ties_and_honours_preferred():
    picker = LoadPicker()
    firsts = {picker.order(["a:1", "b:1", "c:1"])[0] for _ in range(6)}
    assert firsts == {"a:1", "b:1", "c:1"}
    with picker.track("b:1"):
        order = picker.order(["a:1", "b:1"], preferred="b:1")
    assert order == ["b:1", "a:1"]
    assert picker.order([]) == []


def test_picker_releases_on_error():
    picker = LoadPicker()
    with pytest.raises(RuntimeError), picker.track("a:1"):
        raise RuntimeError()
    assert picker.in_flight("a:1") == 0
