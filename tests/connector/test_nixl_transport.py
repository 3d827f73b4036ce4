"""Real NIXL agents (UCX over loopback, CPU DRAM) in separate OS processes.

The consumer is this pytest process; producers are spawned `PeerProcess`es.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl._api")

from pdpool.engine.connector.allowlist import PeerNotAllowedError, parse_allowlist  # noqa: E402
from pdpool.engine.connector.handshake import IncompatiblePeerError  # noqa: E402
from pdpool.engine.connector.nixl_transport import (  # noqa: E402
    NixlTransport,
    TransferState,
    TransportError,
)
from pdpool.engine.connector.peering import connect_peer  # noqa: E402
from pdpool.engine.connector.regions import RegionError  # noqa: E402

from tests.support.peer_process import (  # noqa: E402
    BLOCK_SHAPE,
    NUM_BLOCKS,
    NUM_SLOTS,
    STATE_SHAPE,
    PeerProcess,
    layout,
    pattern,
)

# peers in processes of their own: the full run's tier
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
LOOPBACK = parse_allowlist("")


@pytest.fixture(scope="module")
def processes():
    """All peers of this module, started together: spawning (torch import) is the slow part."""
    started = {}
    try:
        for name, seed in [
            ("prefill-a", 1),
            ("prefill-b", 2),
            ("prefill-doomed", 3),
            ("prefill-frozen", 4),
        ]:
            started[name] = PeerProcess(name, seed)
        yield {name: p.ready() for name, p in started.items()}
    finally:
        for p in started.values():
            p.request_stop()
        for p in started.values():
            p.stop()


@pytest.fixture(scope="module")
def producers(processes):
    return [processes["prefill-a"], processes["prefill-b"]]


@pytest.fixture(scope="module")
def consumer():
    transport = NixlTransport("decode")
    kv = torch.zeros((NUM_BLOCKS, *BLOCK_SHAPE), dtype=torch.int64)
    state = torch.zeros((NUM_SLOTS, *STATE_SHAPE), dtype=torch.int64)
    transport.register_region("kv", kv)
    transport.register_region("state", state)
    transport.tensors = {"kv": kv, "state": state}  # for the tests' eyes only
    yield transport
    transport.close()


@pytest.fixture
def clean(consumer):
    for t in consumer.tensors.values():
        t.zero_()
    return consumer


def wait(transport, tid, limit_s=30.0):
    deadline = time.monotonic() + limit_s
    while transport.poll(tid) is TransferState.IN_PROGRESS:
        assert time.monotonic() < deadline, "transfer neither finished nor failed"
        time.sleep(0.001)
    return transport.poll(tid)


def connect(consumer, producer):
    return connect_peer(
        consumer, "127.0.0.1", producer.port, allowlist=LOOPBACK, local_layout=layout()
    ).agent_name


def test_reads_exactly_the_requested_blocks(clean, producers):
    prod = producers[0]
    peer = connect(clean, prod)
    assert peer == prod.agent_name
    assert connect(clean, prod) == peer  # connecting again replaces, never duplicates
    assert clean.peers.count(peer) == 1
    before = clean.bytes_read
    tid = clean.start_read(peer, {"kv": ([0, 1, 2], [3, 7, 1])})
    assert wait(clean, tid) is TransferState.DONE
    with pytest.raises(TransportError, match="register every region before"):
        clean.register_region("late", torch.zeros((2, 2)))
    assert clean.release(tid)
    expected = pattern(1, "kv")
    kv = clean.tensors["kv"]
    # NIXL moves bytes: every read in this file is a copy, compared bit-exact.
    assert torch.equal(kv[0], expected[3])
    assert torch.equal(kv[1], expected[7])
    assert torch.equal(kv[2], expected[1])
    assert not kv[3:].any(), "blocks outside the read were written"
    unit = clean.regions["kv"].unit_bytes
    assert unit == kv[0].numel() * 8
    assert clean.bytes_read - before == 3 * unit


def test_reads_two_regions_into_scattered_ids_with_one_notification(clean, producers):
    prod = producers[0]
    peer = connect(clean, prod)
    prod.notifications(wait_s=0.2)  # drain earlier tests' notifications
    tid = clean.start_read(
        peer, {"kv": ([15, 4, 9], [0, 15, 8]), "state": ([2], [3])}, notification=b"req-42"
    )
    assert wait(clean, tid) is TransferState.DONE
    clean.release(tid)
    kv, state = clean.tensors["kv"], clean.tensors["state"]
    expected = pattern(1, "kv")
    for local, remote in [(15, 0), (4, 15), (9, 8)]:
        assert torch.equal(kv[local], expected[remote])
    assert torch.equal(state[2], pattern(1, "state")[3])
    assert not state[[0, 1, 3]].any()
    assert prod.notifications(expect=1) == [(clean.agent_name, b"req-42")]


def test_a_read_of_nothing_still_notifies(clean, producers):
    prod = producers[0]
    peer = connect(clean, prod)
    prod.notifications(wait_s=0.2)
    before = clean.bytes_read
    tid = clean.start_read(peer, {"kv": ([], [])}, notification="free-everything")
    assert clean.poll(tid) is TransferState.DONE
    assert clean.release(tid)
    assert clean.bytes_read == before
    assert prod.notifications(expect=1) == [(clean.agent_name, b"free-everything")]


@pytest.mark.parametrize(
    "units, error, match",
    [
        ({"kv": ([0], [NUM_BLOCKS])}, RegionError, r"remote region 'kv': ids \[16\] out of range"),
        ({"kv": ([-1], [0])}, RegionError, r"local region 'kv': ids \[-1\] out of range"),
        ({"kv": ([0, 1], [0])}, RegionError, "2 local ids for 1 remote ids"),
        ({"kv": ([3, 3], [0, 1])}, RegionError, "written twice"),
        ({"state": ([0], [NUM_SLOTS + 3])}, RegionError, r"ids \[7\] out of range"),
        ({"kv": (["x"], [0])}, RegionError, "not an integer"),
        ({"nope": ([0], [0])}, RegionError, "not registered here"),
    ],
)
def test_bogus_ids_are_refused_before_anything_is_issued(clean, producers, units, error, match):
    prod = producers[0]
    peer = connect(clean, prod)
    prod.notifications(wait_s=0.2)
    counters = (clean.bytes_read, clean.reads_done, clean.reads_failed)
    with pytest.raises(error, match=match):
        clean.start_read(peer, units, notification=b"must-not-arrive")
    assert (clean.bytes_read, clean.reads_done, clean.reads_failed) == counters
    assert prod.notifications(wait_s=0.5) == []
    assert not any(t.any() for t in clean.tensors.values())


def test_unknown_peer_is_refused(clean):
    with pytest.raises(TransportError, match="unknown peer"):
        clean.start_read("nobody", {"kv": ([0], [0])})


def test_three_processes_read_concurrently_and_a_producer_also_consumes(clean, producers):
    a, b = producers
    pa, pb = connect(clean, a), connect(clean, b)
    for p in producers:
        p.notifications(wait_s=0.2)
    ta = clean.start_read(pa, {"kv": ([0, 1], [5, 6])}, notification=b"from-a")
    tb = clean.start_read(pb, {"kv": ([2, 3], [5, 6])}, notification=b"from-b")
    assert wait(clean, ta) is TransferState.DONE and wait(clean, tb) is TransferState.DONE
    clean.release(ta), clean.release(tb)
    kv = clean.tensors["kv"]
    assert torch.equal(kv[0:2], pattern(1, "kv")[5:7])
    assert torch.equal(kv[2:4], pattern(2, "kv")[5:7])
    assert a.notifications(expect=1) == [(clean.agent_name, b"from-a")]
    assert b.notifications(expect=1) == [(clean.agent_name, b"from-b")]

    # role "both": b reads a's blocks 10, 11 over its own blocks 0, 1
    state, blocks, bytes_read = b.call("read", a.port, [0, 1], [10, 11], "b-pulled")
    assert state == "done"
    assert torch.equal(torch.stack(blocks), pattern(1, "kv")[10:12])
    assert bytes_read == 2 * clean.regions["kv"].unit_bytes
    assert a.notifications(expect=1) == [(b.agent_name, b"b-pulled")]


def test_incompatible_block_size_is_refused_naming_the_field(clean, producers):
    peers_before = clean.peers
    with pytest.raises(IncompatiblePeerError, match=r"block_size: ours 16, peer 4"):
        connect_peer(
            clean,
            "127.0.0.1",
            producers[0].port,
            allowlist=LOOPBACK,
            local_layout=layout(block_size=16),
        )
    assert clean.peers == peers_before


def test_peer_outside_the_allowlist_is_refused(clean, producers):
    with pytest.raises(PeerNotAllowedError, match="not in the KV peer allowlist"):
        connect_peer(
            clean,
            "127.0.0.1",
            producers[0].port,
            allowlist=parse_allowlist("10.0.0.0/8", include_loopback=False),
            local_layout=layout(),
        )


def test_region_with_a_different_unit_layout_is_refused(producers):
    with NixlTransport("odd") as odd:
        odd.register_region("kv", torch.zeros((NUM_BLOCKS, 7), dtype=torch.int64))
        with pytest.raises(RegionError, match="unit layout"):
            connect_peer(
                odd, "127.0.0.1", producers[0].port, allowlist=LOOPBACK, local_layout=layout()
            )
        assert odd.peers == []


def _assert_clean(transport, gone_peer):
    assert gone_peer not in transport.peers
    assert transport.pending_releases() == 0
    assert transport.transfer_ids == []


def test_producer_killed_after_handshake(clean, producers, processes):
    victim = processes["prefill-doomed"]
    try:
        peer = connect(clean, victim)
        victim.kill()
        tid = clean.start_read(peer, {"kv": ([0, 1], [0, 1])}, notification=b"x", timeout_s=10)
        assert wait(clean, tid, limit_s=15) is TransferState.FAILED
        assert clean.transfer(tid).error
        assert clean.release(tid)
        clean.remove_peer(peer)
        _assert_clean(clean, peer)
    finally:
        victim.kill()
    # the consumer carries on with the living
    tid = clean.start_read(connect(clean, producers[1]), {"kv": ([6], [2])})
    assert wait(clean, tid) is TransferState.DONE
    assert torch.equal(clean.tensors["kv"][6], pattern(2, "kv")[2])
    clean.release(tid)


def test_unresponsive_producer_times_out_and_the_read_is_cancelled(clean, processes):
    victim = processes["prefill-frozen"]
    try:
        info = connect_peer(
            clean, "127.0.0.1", victim.port, allowlist=LOOPBACK, local_layout=layout()
        )
        peer = info.agent_name
        os.kill(victim.process.pid, signal.SIGSTOP)  # alive but never answers
        tid = clean.start_read(
            peer,
            {"kv": (list(range(NUM_BLOCKS)), list(range(NUM_BLOCKS)))},
            notification=b"x",
            timeout_s=1.0,
        )
        started = time.monotonic()
        # the engine may repeat a handshake while a read is in flight: it must not kill it
        assert clean.add_peer(info.document.agent_metadata, info.document.regions) == peer
        assert clean.poll(tid) is TransferState.IN_PROGRESS
        assert wait(clean, tid, limit_s=10) is TransferState.FAILED
        assert time.monotonic() - started >= 0.9
        assert clean.transfer(tid).error == "timed out"
        assert clean.release(tid)
        clean.remove_peer(peer)
        _assert_clean(clean, peer)
    finally:
        os.kill(victim.process.pid, signal.SIGCONT)
        victim.kill()


def test_a_peer_whose_regions_changed_is_replaced(clean, producers):
    info = connect_peer(
        clean, "127.0.0.1", producers[0].port, allowlist=LOOPBACK, local_layout=layout()
    )
    doc = info.document
    assert clean.add_peer(doc.agent_metadata, {"kv": doc.regions["kv"]}) == info.agent_name
    assert list(clean.peer_regions(info.agent_name)) == ["kv"]
    with pytest.raises(RegionError, match="has no region 'state'"):
        clean.start_read(info.agent_name, {"state": ([0], [0])})
    tid = clean.start_read(info.agent_name, {"kv": ([5], [9])})
    assert wait(clean, tid) is TransferState.DONE
    assert torch.equal(clean.tensors["kv"][5], pattern(1, "kv")[9])
    clean.release(tid)
    connect(clean, producers[0])
    assert sorted(clean.peer_regions(info.agent_name)) == ["kv", "state"]


def test_registration_errors():
    with NixlTransport("regs") as t:
        kv = torch.zeros((4, 8), dtype=torch.int64)
        layout_ = t.register_region("kv", kv)
        assert layout_.unit_bytes == 64 and t.mem_type == "DRAM"
        with pytest.raises(RegionError, match="already registered"):
            t.register_region("kv", kv)
        with pytest.raises(RegionError, match="contiguous"):
            t.register_region("state", torch.zeros((8, 4)).t())
        assert list(t.regions) == ["kv"]
    with pytest.raises(TransportError, match="closed"):
        t.agent_metadata()
