"""One endpoint pool (sidecar/routing/pool.py) for the gateway's and EPP's decode set and the
sidecar's prefill set: load, health, ejection and probes, without HTTP."""

from __future__ import annotations

from pdpool.sidecar.net.discovery import EndpointSet
from pdpool.sidecar.routing.outlier import OutlierDetector
from pdpool.sidecar.routing.pool import EndpointPool


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool_of(names: list[str], clock: Clock, **hooks) -> EndpointPool:
    outliers = OutlierDetector(probe_failures=1, base_ejection_s=2.0, clock=clock)
    return EndpointPool(EndpointSet(names), outliers, **hooks)


async def test_probes_make_endpoints_unhealthy_and_readmit_them_after_the_ejection():
    clock, marked = Clock(), []
    pool = pool_of(["a:1", "b:1"], clock, on_mark=marked.append)
    answers = {"a:1": False, "b:1": True}

    async def probe(endpoint: str) -> bool:
        return answers[endpoint]

    await pool.probe_all(probe)
    assert sorted(marked) == ["a:1", "b:1"]
    assert pool.healthy_endpoints() == ["b:1"] and pool.available() == ["b:1"]
    answers["a:1"] = True
    await pool.probe_all(probe)  # good again, but still within its ejection
    assert not pool.healthy("a:1")
    clock.now += 2.0
    await pool.probe_all(probe, ["a:1"])
    assert pool.healthy("a:1") and pool.available() == ["a:1", "b:1"]


def test_requests_in_flight_order_the_pool_and_are_reported():
    changes: list[tuple[str, int]] = []
    pool = pool_of(["a:1", "b:1"], Clock(), on_load=lambda e, d: changes.append((e, d)))
    with pool.tracked("a:1"), pool.tracked("a:1"):
        assert pool.load("a:1") == 2 and pool.by_load(pool.current) == ["b:1", "a:1"]
        assert pool.by_load(pool.current, preferred="a:1")[0] == "a:1"
    assert pool.load("a:1") == 0
    assert changes == [("a:1", 1), ("a:1", 1), ("a:1", -1), ("a:1", -1)]


def test_a_request_that_raises_still_leaves_the_count():
    pool = pool_of(["a:1"], Clock())
    try:
        with pool.tracked("a:1"):
            raise RuntimeError("upstream went away")
    except RuntimeError:
        pass
    assert pool.load("a:1") == 0
