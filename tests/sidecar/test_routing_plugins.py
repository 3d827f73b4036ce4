"""Routing composed from plugins (sidecar/routing/framework.py, plugins.py) and the one P/D
decision module (pd.py): what each plugin changes in the order, and where P/D flips."""

from __future__ import annotations

import random

from pdpool.sidecar.kv.costs import PromptCosts
from pdpool.sidecar.routing.framework import MaxScorePicker, Profile, Weighted
from pdpool.sidecar.routing.pd import DecodeFirstDecider, PrefixHitDecider
from pdpool.sidecar.routing.plugins import (
    HealthFilter,
    LoadScorer,
    UnderLoadCap,
    adapter_profile,
    precise_profile,
)


def costs(work: dict[str, float], hits: dict[str, int] | None = None) -> PromptCosts:
    return PromptCosts([], 100, hits or dict.fromkeys(work, 0), work, True)


def test_health_filter_puts_unhealthy_endpoints_last_in_their_order():
    profile = Profile([HealthFilter(lambda e: e not in {"a", "c"})], [])
    assert profile.order(["a", "b", "c", "d"]) == ["b", "d", "a", "c"]


def test_the_load_weight_decides_between_cache_and_load():
    # a holds 100 more tokens of the prompt; b has one request fewer in flight.
    c = costs({"a": 0.0, "b": 100.0})
    load = {"a": 1, "b": 0}.__getitem__
    healthy = lambda e: True  # noqa: E731
    assert precise_profile(c, load, 64.0, healthy).order(["b", "a"]) == ["a", "b"]
    assert precise_profile(c, load, 200.0, healthy).order(["a", "b"]) == ["b", "a"]


def test_an_extra_cost_moves_the_pick():
    c = costs({"a": 0.0, "b": 10.0})
    idle = lambda e: 0  # noqa: E731
    healthy = lambda e: True  # noqa: E731
    assert precise_profile(c, idle, 64.0, healthy).order(["a", "b"])[0] == "a"
    adapter = {"a": 32.0, "b": 0.0}.__getitem__  # the adapter is not loaded on a
    assert precise_profile(c, idle, 64.0, healthy, adapter).order(["a", "b"])[0] == "b"


def test_equal_scores_keep_the_affinity_order():
    assert MaxScorePicker().pick(["c", "a", "b"], {"a": 1.0, "b": 1.0, "c": 1.0}) == ["c", "a", "b"]
    profile = Profile([], [Weighted(LoadScorer(lambda e: 0))])
    assert profile.order(["z", "y", "x"]) == ["z", "y", "x"]


def test_precise_profile_orders_by_the_documented_cost():
    """cost = work + load_cost * load among the healthy, ties in affinity order, the
    unhealthy after them: the formula of sidecar/kv/costs.py, on random pools."""
    rng = random.Random(7)
    for _ in range(300):
        names = [f"e{i}" for i in range(rng.randint(1, 6))]
        work = {e: float(rng.choice([0, 16, 32, 48, 64.5])) for e in names}
        loads = {e: rng.randint(0, 3) for e in names}
        sick = {e for e in names if rng.random() < 0.2}
        extra = {e: rng.choice([0.0, 8.0, 64.0]) for e in names}
        lc = rng.choice([0.0, 1.0, 64.0])
        order = rng.sample(names, len(names))
        got = precise_profile(
            costs(work),
            loads.__getitem__,
            lc,
            lambda e, sick=sick: e not in sick,
            extra.__getitem__,
        ).order(order)
        pos = {e: i for i, e in enumerate(order)}
        alive = sorted(
            (e for e in order if e not in sick),
            key=lambda e: (work[e] + extra[e] + lc * loads[e], pos[e]),
        )
        assert got == alive + [e for e in order if e in sick]


def test_adapter_profile_prefers_residency_under_the_load_cap():
    residency = {"a": 0.0, "b": 1.0, "c": 1.0}
    loads = {"a": 0, "b": 5, "c": 0}
    got = adapter_profile(residency, loads.__getitem__, lambda e: True, 1.25).order(["a", "b", "c"])
    # b holds the adapter but is over the cap (ceil(1.25 * 6 / 3) = 3): c, then a, then b.
    assert got == ["c", "a", "b"]
    assert UnderLoadCap(loads.__getitem__, 1.25).filter(["a", "b", "c"]) == ["a", "c"]


def test_prefix_hit_decider_flips_at_the_threshold():
    decider = PrefixHitDecider(0.5)
    assert decider.decide(50, 100) == "decode"  # at the threshold: decode can serve it
    assert decider.decide(49, 100) == "pd"
    assert decider.decide(0, 0) == "decode"  # nothing to prefill
    assert PrefixHitDecider(0.0).decide(0, 100) == "decode"


def test_decode_first_decider():
    d = DecodeFirstDecider(min_prompt_tokens=128)
    long_body, short_body = {"prompt": "x" * 512}, {"prompt": "x" * 100}
    assert (d.decide("pd", True, short_body).step, d.decide("pd", True, short_body).by) == (
        "pd",
        "router",
    )
    # an engine that cannot reject: the prompt's length decides, whatever the router said
    assert d.decide("decode", False, long_body).step == "pd"
    assert d.decide(None, False, short_body).step == "decode"
    assert d.decide(None, False, {"prompt": [1] * 128}).step == "pd"
    # one that can (or is not known yet): it is asked
    assert d.decide(None, True, long_body).step == "ask_decode"
    assert d.decide("decode", None, long_body).step == "ask_decode"
