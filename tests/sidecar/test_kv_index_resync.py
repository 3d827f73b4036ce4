"""An engine whose events were lost is not trusted, and is trusted again once a replay of
its whole history rebuilds the index of it (pure: no sockets, the replay is a list)."""

from __future__ import annotations

from pdpool.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pdpool.sidecar.kv.index import KVIndex


def stored(*hashes: int) -> KVEventBatch:
    return KVEventBatch(0.0, [BlockStored(list(hashes), None, [], 1, None, "GPU", 0, None)])


def history() -> list[tuple[int, KVEventBatch]]:
    """What the engine published, seq by seq: cleared at start, then blocks come and go."""
    return [
        (0, KVEventBatch(0.0, [AllBlocksCleared()])),
        (1, stored(11, 12)),
        (2, stored(21)),
        (3, KVEventBatch(0.0, [BlockRemoved([11], "GPU")])),
        (4, stored(41)),
        (5, stored(51)),
        (6, stored(61)),
    ]


class Replays:
    """An engine's replay socket holding `buffer` (each call counted)."""

    def __init__(self, buffer: list[tuple[int, KVEventBatch]]) -> None:
        self.buffer, self.calls = buffer, 0

    def __call__(self, start: int) -> list[tuple[int, KVEventBatch]]:
        self.calls += 1
        return [(s, b) for s, b in self.buffer if s >= start]


def feed_with_loss(index: KVIndex, replay: Replays) -> None:
    """Messages 0-2 arrive, 3 is lost and its replay fails, 4 arrives."""
    events = history()
    for seq, batch in events[:3]:
        index.on_message("e", seq, batch, replay=replay)
    index.on_message("e", 4, events[4][1], replay=lambda start: [])


def test_lost_events_untrust_the_engine_until_its_whole_history_is_replayed():
    index, replay = KVIndex(), Replays(history())
    feed_with_loss(index, replay)
    assert not index.knows("e") and index.prefix_hit_blocks("e", [12]) is None
    assert "e" not in index.block_counts()
    # Not asked again at once: a replay that just failed would fail again.
    index.on_message("e", 5, history()[5][1], replay=replay)
    assert replay.calls == 0 and not index.knows("e")
    index.engines["e"].resync_at = 0.0  # its time has come
    index.on_message("e", 6, history()[6][1], replay=replay)
    assert replay.calls == 1 and index.knows("e")
    # Exactly the engine's blocks: 11 was removed in the lost message.
    assert set(index.engines["e"].blocks) == {12, 21, 41, 51, 61}
    assert index.block_counts() == {"e": 5}


def test_an_engine_whose_history_is_no_longer_buffered_stays_untrusted():
    index, replay = KVIndex(), Replays(history()[2:])  # the buffer has dropped 0 and 1
    feed_with_loss(index, replay)
    index.engines["e"].resync_at = 0.0
    index.on_message("e", 5, history()[5][1], replay=replay)
    assert replay.calls == 1 and not index.knows("e")
    # A buffer that has let go of its start never holds it again: not asked any more.
    assert index.engines["e"].resync_at == float("inf")
    # An AllBlocksCleared (the engine's cache reset) still makes it known again.
    index.on_message("e", 6, KVEventBatch(0.0, [AllBlocksCleared()]), replay=replay)
    assert index.knows("e") and index.block_counts() == {"e": 0}


def test_a_replay_runs_without_the_index_lock_held():
    """A replay socket may take its full timeout to answer; routing reads the index
    meanwhile (pending work, expectations, the gauges), so the replay must not hold it."""
    index = KVIndex()
    free_during_replay = []

    def replay(start: int) -> list[tuple[int, KVEventBatch]]:
        got = index._lock.acquire(timeout=1)
        if got:
            index._lock.release()
        free_during_replay.append(got)
        return [(s, b) for s, b in history() if s >= start]

    index.on_message("e", 0, history()[0][1], replay=replay)
    index.on_message("e", 3, history()[3][1], replay=replay)  # 1 and 2 lost: replayed
    assert free_during_replay == [True]
    assert set(index.engines["e"].blocks) == {12, 21}


def test_an_unanswered_replay_is_asked_again_later():
    index = KVIndex()
    feed_with_loss(index, Replays(history()))
    index.engines["e"].resync_at = 0.0
    index.on_message("e", 5, history()[5][1], replay=lambda start: [])  # no answer in time
    st = index.engines["e"]
    assert not index.knows("e") and 0.0 < st.resync_at < float("inf")
    st.resync_at = 0.0
    index.on_message("e", 6, history()[6][1], replay=Replays(history()))
    assert index.knows("e") and set(st.blocks) == {12, 21, 41, 51, 61}


def test_a_replay_out_of_order_or_with_holes_is_not_trusted():
    """A replay socket that answers with messages repeated, reordered or missing (a bad or
    hostile publisher) never makes an untrusted engine trusted, nor fills a gap."""
    full = history()
    bad_answers = [
        [full[0], full[2], full[1], *full[3:]],  # reordered
        [full[0], full[1], full[1], *full[2:]],  # repeated
        [full[0], *full[2:]],  # a hole
        [(s + 100, b) for s, b in full],  # from another numbering
    ]
    for answer in bad_answers:
        index = KVIndex()
        feed_with_loss(index, Replays(full))
        index.engines["e"].resync_at = 0.0
        index.on_message("e", 5, full[5][1], replay=lambda start, answer=answer: answer)
        assert not index.knows("e"), answer
        # A gap whose replay is bad leaves the engine untrusted as well.
        index = KVIndex()
        index.on_message("e", 0, full[0][1])
        index.on_message("e", 4, full[4][1], replay=lambda start, answer=answer: answer)
        assert not index.knows("e"), answer
