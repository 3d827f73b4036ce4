"""Prefix affinity keys and the consistent-hash ring with bounded loads."""

from collections import Counter

from pdpool.sidecar.routing.affinity import HashRing, affinity_key, route_order


def test_turns_of_a_conversation_share_a_key():
    history = [
        {"role": "system", "content": "You are terse. " * 10},
        {"role": "user", "content": "tell me about ships " * 10},
    ]
    turn2 = [*history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    assert affinity_key({"messages": history}) == affinity_key({"messages": turn2})
    other = [
        {"role": "system", "content": "You are terse. " * 10},
        {"role": "user", "content": "tell me about trains " * 10},
    ]
    assert affinity_key({"messages": history}) != affinity_key({"messages": other})
    assert affinity_key({"prompt": "x" * 1000}, 100) == "x" * 100
    assert affinity_key({"prompt": list(range(500))}, 40) == repr(list(range(10)))
    assert affinity_key("junk") == "" and affinity_key({"messages": ["bad"]}) == ""


def test_ring_spreads_keys_and_keeps_most_in_place_when_a_backend_leaves():
    three = HashRing(["a:1", "b:1", "c:1"])
    owners = {str(k): three.walk(str(k))[0] for k in range(3000)}
    counts = Counter(owners.values())
    assert min(counts.values()) > 700
    two = HashRing(["a:1", "b:1"])
    moved = sum(1 for k, o in owners.items() if o != "c:1" and two.walk(k)[0] != o)
    assert moved == 0
    assert sorted(three.walk("k")) == ["a:1", "b:1", "c:1"]
    assert HashRing([]).walk("k") == []


def test_route_order_prefers_owner_spills_when_overloaded_and_skips_unhealthy():
    ring = HashRing(["a:1", "b:1", "c:1"])
    walk = ring.walk("conv-1")
    owner = walk[0]
    idle = {b: 0 for b in walk}
    order, preferred = route_order(ring, "conv-1", idle.get, lambda b: True)
    assert order == walk and preferred
    busy = {**idle, owner: 10}
    order, preferred = route_order(ring, "conv-1", busy.get, lambda b: True)
    assert order[0] == walk[1] and not preferred and set(order) == set(walk)
    order, preferred = route_order(ring, "conv-1", idle.get, lambda b: b != owner)
    assert order == [*walk[1:], owner] and preferred
    order, preferred = route_order(ring, "conv-1", idle.get, lambda b: False)
    assert order == walk and not preferred
