"""The engine server <-> core transport never takes load for death: big messages and bursts
wait for a busy peer (even with uvloop running in the process), a sender is held back while
too much is queued, and only the peer's end closing ends the channel."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time

import pytest

from pdpool.engine.core_channel import ChannelClosed, CoreChannel


class Inbox:
    def __init__(self) -> None:
        self.messages: list = []
        self.closed: list[str] = []
        self.got = threading.Event()

    def on_messages(self, msgs: list) -> None:
        self.messages += msgs
        self.got.set()

    def on_closed(self, why: str) -> None:
        self.closed.append(why)


def _pair(max_pending_bytes: int = 64 << 20):
    a, b = multiprocessing.Pipe(duplex=True)
    ia, ib = Inbox(), Inbox()
    ca = CoreChannel(a, ia.on_messages, ia.on_closed, "a", max_pending_bytes)
    cb = CoreChannel(b, ib.on_messages, ib.on_closed, "b", max_pending_bytes)
    return (ca, ia), (cb, ib)


def _wait(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_50mb_message_waits_for_a_peer_that_reads_late_under_uvloop():
    uvloop = pytest.importorskip("uvloop")
    (ca, _), (cb, ib) = _pair()
    big = list(range(6_000_000))  # ~30-50 MB pickled: far more than a socket buffer

    async def main():
        # An event loop of the kind uvicorn runs; the channel never hands it the socket.
        ca.start()
        ca.send(("big", big))
        ca.send(("after", 1))
        await asyncio.sleep(1.0)  # the peer does not read meanwhile
        assert not ca.closed
        cb.start()
        await asyncio.get_running_loop().run_in_executor(None, _wait, lambda: len(ib.messages) == 2)

    uvloop.run(main())
    assert ib.messages[0] == ("big", big) and ib.messages[1] == ("after", 1)
    assert ib.closed == [] and not ca.closed
    ca.flush_and_close()
    cb.flush_and_close()


def test_a_burst_arrives_whole_and_in_order():
    (ca, _), (cb, ib) = _pair()
    ca.start()
    cb.start()
    for i in range(20_000):
        ca.send(("add", i, [i] * 50))
    _wait(lambda: len(ib.messages) == 20_000)
    assert [m[1] for m in ib.messages] == list(range(20_000))
    ca.flush_and_close()
    cb.flush_and_close()


def test_a_sender_is_held_back_while_too_much_is_queued():
    (ca, _), (cb, ib) = _pair(max_pending_bytes=1 << 20)
    ca.start()  # the peer does not read yet: the queue fills
    for _ in range(8):
        ca.send(b"x" * (1 << 20))
    assert not ca.has_room()
    assert ca.wait_room(timeout=0.3) is False

    async def held_back() -> float:
        t0 = time.monotonic()
        threading.Timer(0.5, cb.start).start()  # the peer starts reading later
        await ca.wait_room_async()
        return time.monotonic() - t0

    assert asyncio.run(held_back()) >= 0.4
    _wait(lambda: len(ib.messages) == 8)
    ca.flush_and_close()
    cb.flush_and_close()


def test_a_send_into_an_idle_socket_needs_no_writer_thread():
    (ca, _), (cb, ib) = _pair()
    cb.start()  # ca's own threads are not started: nothing of ca's can write but the sender
    ca.send(("small", 1))
    _wait(lambda: len(ib.messages) == 1)
    big = b"y" * (8 << 20)  # more than the socket takes at once: the rest waits for the writer
    ca.send(("big", big))
    ca.send(("after", 2))
    time.sleep(0.3)
    assert len(ib.messages) == 1  # the big one cannot arrive whole without the writer
    ca.start()
    _wait(lambda: len(ib.messages) == 3)
    assert ib.messages == [("small", 1), ("big", big), ("after", 2)]
    ca.flush_and_close()
    cb.flush_and_close()


def test_senders_on_many_threads_against_a_stalled_peer_lose_and_mix_nothing():
    (ca, _), (cb, ib) = _pair()
    ca.start()  # the peer reads only once every sender is done: the socket fills first
    sizes = [10, 70_000, 1 << 20, 3]  # below, around and far above a socket buffer

    def sender(t: int) -> None:
        for i in range(200):
            ca.send((t, i, b"z" * sizes[(t + i) % len(sizes)]))

    threads = [threading.Thread(target=sender, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads), "a send blocked on a stalled peer"
    cb.start()
    _wait(lambda: len(ib.messages) == 800)
    for t in range(4):
        mine = [m for m in ib.messages if m[0] == t]
        assert [m[1] for m in mine] == list(range(200))
        assert all(m[2] == b"z" * sizes[(t + m[1]) % len(sizes)] for m in mine)
    _wait(lambda: ca.has_room() and ca.wait_room(0))
    ca.flush_and_close()
    cb.flush_and_close()


def _child(conn) -> None:
    conn.recv_bytes()  # then exit: its end of the socket closes


@pytest.mark.slow  # a child process
def test_only_the_peer_exiting_closes_the_channel_once():
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_child, args=(b,))
    proc.start()
    b.close()
    inbox = Inbox()
    ch = CoreChannel(a, inbox.on_messages, inbox.on_closed, "a").start()
    ch.send("bye")
    proc.join(30)
    _wait(lambda: inbox.closed)
    time.sleep(0.2)
    assert len(inbox.closed) == 1 and ch.closed
    with pytest.raises(ChannelClosed):
        ch.send("too late")
    ch.flush_and_close()
