"""The lean HTTP/1.1 client of the hot path, against raw asyncio servers."""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvloop

from pdpool.ports import free_port
from pdpool.sidecar.net.http1 import (
    ChunkedBody,
    Http1Pool,
    UpstreamConnectError,
    UpstreamProtocolError,
)
from pdpool.sidecar.net.resolver import Resolver


async def raw_server(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def read_request(reader):
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = int(next(h for h in lines if h.lower().startswith(b"content-length")).split(b":")[1])
    return head, await reader.readexactly(length)


async def test_chunked_and_content_length_bodies_and_keep_alive_reuse():
    connections = []

    async def handler(reader, writer):
        connections.append(writer)
        while True:
            try:
                head, body = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            if b"/chunked" in head:
                writer.write(
                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n"
                    b"x-test: yes\r\n\r\n5\r\nhello\r\n1;ext=1\r\n \r\n5\r\n"
                    + body[:5]
                    + b"\r\n0\r\n\r\n"
                )
            else:
                writer.write(
                    b"HTTP/1.1 201 Created\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
                )
            await writer.drain()

    server, port = await raw_server(handler)
    pool = Http1Pool()
    async with server:
        r = await pool.send("POST", f"http://127.0.0.1:{port}/chunked", b"world!!")
        assert r.status_code == 200 and r.headers["x-test"] == "yes"
        # what arrived in one read comes out as one piece: chunk boundaries mean nothing
        assert b"".join([c async for c in r.aiter_raw()]) == b"hello world"
        assert r.complete
        await r.aclose()
        r = await pool.send(
            "POST",
            f"http://127.0.0.1:{port}/echo?x=1",
            b'{"a": 1}',
            {"content-type": "application/json"},
        )
        assert r.status_code == 201 and await r.aread() == b'{"a": 1}'
        await r.aclose()
        assert len(connections) == 1  # one keep-alive connection served both
        await pool.aclose()


async def test_stale_keep_alive_connection_is_replaced_once():
    served = []

    async def handler(reader, writer):
        await read_request(reader)
        served.append(1)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # the server drops keep-alive connections after one request

    server, port = await raw_server(handler)
    pool = Http1Pool()
    async with server:
        for _ in range(3):
            r = await pool.send("GET", f"http://127.0.0.1:{port}/", b"")
            assert await r.aread() == b"ok"
            await r.aclose()
            await asyncio.sleep(0.05)
    assert len(served) == 3
    await pool.aclose()


async def test_refused_broken_and_garbage_answers_raise_upstream_errors():
    dead = free_port()
    pool = Http1Pool(connect_timeout=1)
    with pytest.raises(UpstreamConnectError):
        await pool.send("GET", f"http://127.0.0.1:{dead}/", b"")

    async def broken(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel")
        await writer.drain()
        writer.close()

    async def garbage(reader, writer):
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        writer.close()

    for handler in (broken, garbage):
        server, port = await raw_server(handler)
        async with server:
            with pytest.raises(UpstreamProtocolError):
                r = await pool.send("GET", f"http://127.0.0.1:{port}/", b"")
                await r.aread()
    with pytest.raises(UpstreamProtocolError):
        await pool.send("GET", "ftp://127.0.0.1/", b"")
    with pytest.raises(UpstreamConnectError):  # https:// is spoken (TLS), here refused
        await pool.send("GET", f"https://127.0.0.1:{dead}/", b"")


async def _endless_stream_server(piece: bytes) -> tuple[asyncio.Server, int, asyncio.Event]:
    """A server streaming `piece` every 10 ms until its client closes (then the event is set)."""
    closed = asyncio.Event()

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            while True:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            closed.set()

    server, port = await raw_server(handler)
    return server, port, closed


async def test_closing_an_unfinished_stream_closes_the_connection():
    server, port, closed = await _endless_stream_server(b"3\r\nabc\r\n")
    pool = Http1Pool()
    async with server:
        r = await pool.send("POST", f"http://127.0.0.1:{port}/", b"{}")
        async for chunk in r.aiter_raw():
            assert chunk.startswith(b"abc")
            break
        await r.aclose()
        await asyncio.wait_for(closed.wait(), 5)
    assert pool._idle.get(("127.0.0.1", port, False), []) == []


def _feed_in_pieces(body: bytes, size: int) -> tuple[bytes, ChunkedBody]:
    decoder = ChunkedBody()
    out = b""
    for i in range(0, len(body), size):
        out += decoder.feed(body[i : i + size])
    return out, decoder


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_chunked_body_decodes_whatever_the_reads_are(size):
    body = b"5\r\nhello\r\n1;ext=1\r\n \r\nA\r\n0123456789\r\n0\r\nx-trailer: 1\r\n\r\n"
    out, decoder = _feed_in_pieces(body, size)
    assert out == b"hello 0123456789" and decoder.done and decoder.extra == b""
    out, decoder = _feed_in_pieces(b"3\r\nabc\r\n0\r\n\r\nHTTP/1.1", size)
    assert out == b"abc" and decoder.done
    assert decoder.extra == b"HTTP/1.1"  # not this body's: the connection is not reused


def test_chunked_body_hands_out_a_payload_before_its_chunk_is_whole():
    decoder = ChunkedBody()
    assert decoder.feed(b"a\r\nfirst") == b"first"  # never held for the rest of the chunk
    assert decoder.feed(b"-half\r\n") == b"-half" and not decoder.done


@pytest.mark.parametrize("bad", [b"zz\r\n", b"-5\r\nabc", b"3\r\nabcXY"])
def test_chunked_body_refuses_broken_framing(bad):
    with pytest.raises(UpstreamProtocolError):
        ChunkedBody().feed(bad)


async def test_a_name_is_resolved_once_for_all_connections(monkeypatch):
    lookups = []
    loop = asyncio.get_running_loop()

    async def slow_getaddrinfo(host, port, **kwargs):
        lookups.append(host)
        await asyncio.sleep(0.05)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    monkeypatch.setattr(loop, "getaddrinfo", slow_getaddrinfo)
    resolver = Resolver(ttl_s=60)
    answers = await asyncio.gather(*(resolver.addresses("engine.local", 80) for _ in range(20)))
    assert answers == [["127.0.0.1"]] * 20 and lookups == ["engine.local"]
    assert await resolver.addresses("engine.local", 80) == ["127.0.0.1"]
    assert await resolver.addresses("10.0.0.1", 80) == ["10.0.0.1"]  # never looked up
    resolver.ttl_s = 0
    resolver.forget("engine.local")
    await resolver.addresses("engine.local", 80)
    assert lookups == ["engine.local"] * 2
    # expired: the old answer serves at once while one refresh runs in the background
    for _ in range(3):
        assert await resolver.addresses("engine.local", 80) == ["127.0.0.1"]
    await asyncio.sleep(0.1)
    assert lookups == ["engine.local"] * 3


async def test_a_dns_name_upstream_is_reached_through_the_resolver():
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    server, port = await raw_server(handler)
    pool = Http1Pool()
    async with server:
        r = await pool.send("GET", f"http://localhost:{port}/", b"")
        assert await r.aread() == b"ok"
        await r.aclose()
    await pool.aclose()


async def _streaming_server(parts: list[bytes], head: bytes, close_after: bool = False):
    """A server answering each request with `head`, then `parts` written 20 ms apart."""

    async def handler(reader, writer):
        try:
            while True:
                await read_request(reader)
                writer.write(head)
                for part in parts:
                    await asyncio.sleep(0.02)
                    writer.write(part)
                    await writer.drain()
                if close_after:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return

    return await raw_server(handler)


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


async def test_a_relayed_body_is_handed_on_from_the_connection_callback_and_reused():
    await _relay_and_reuse()


def test_a_relayed_body_is_handed_on_likewise_on_uvloop():
    uvloop.run(_relay_and_reuse())  # the loop the servers run on (its transports differ)


async def _relay_and_reuse():
    parts = [b"3\r\nabc\r\n", b"2\r\nde\r\n", b"1\r\nf\r\n0\r\n\r\n"]
    server, port = await _streaming_server(parts, CHUNKED_HEAD)
    pool = Http1Pool()
    async with server:
        for _ in range(2):  # the second request reuses the connection
            r = await pool.send("POST", f"http://127.0.0.1:{port}/", b"{}")
            got = []

            def write(piece, last, got=got):
                got.append((piece, last, asyncio.current_task()))

            await r.relay(write)
            # every piece came from the connection's callback, outside any task
            assert [(p, last) for p, last, _ in got] == [
                (b"abc", False),
                (b"de", False),
                (b"f", True),
            ]
            assert all(task is None for _, _, task in got)
            assert r.complete
            await r.aclose()
        assert len(pool._idle[("127.0.0.1", port, False)]) == 1
        await pool.aclose()


async def test_a_relayed_body_without_a_length_ends_at_the_close_and_one_with_a_length_at_it():
    server, port = await _streaming_server(
        [b"hello ", b"world"], b"HTTP/1.1 200 OK\r\n\r\n", close_after=True
    )
    pool = Http1Pool()
    async with server:
        r = await pool.send("POST", f"http://127.0.0.1:{port}/", b"{}")
        got = []
        await r.relay(lambda piece, last: got.append((piece, last)))
        assert got == [(b"hello ", False), (b"world", False), (b"", True)]
        await r.aclose()
    server, port = await _streaming_server(
        [b"hel", b"lo"], b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"
    )
    async with server:
        r = await pool.send("POST", f"http://127.0.0.1:{port}/", b"{}")
        got = []
        await r.relay(lambda piece, last: got.append((piece, last)))
        assert got == [(b"hel", False), (b"lo", True)]
        await r.aclose()
        assert len(pool._idle[("127.0.0.1", port, False)]) == 1
        await pool.aclose()


async def test_a_busy_writer_pauses_the_relay_until_its_write_is_done():
    parts = [b"1\r\na\r\n", b"1\r\nb\r\n", b"1\r\nc\r\n0\r\n\r\n"]
    server, port = await _streaming_server(parts, CHUNKED_HEAD)
    pool = Http1Pool()
    loop = asyncio.get_running_loop()
    gate = loop.create_future()
    got = []

    async def slow_write():
        await gate
        got.append("a written")

    def write(piece, last):
        got.append(piece)
        return slow_write() if piece == b"a" else None

    async with server:
        r = await pool.send("POST", f"http://127.0.0.1:{port}/", b"{}")
        relay = asyncio.ensure_future(r.relay(write))
        await asyncio.sleep(0.2)  # b and c were sent meanwhile, but not read on
        assert got == [b"a"] and not relay.done()
        gate.set_result(None)
        await asyncio.wait_for(relay, 5)
        # what came in while paused is read at once, in order
        assert got[:2] == [b"a", "a written"] and b"".join(got[2:]) == b"bc"
        await r.aclose()
        await pool.aclose()


@pytest.mark.parametrize("framing", ["until the close", "chunked"])
async def test_a_connection_lost_while_a_write_waits_is_seen_once_the_write_is_done(framing):
    head = b"HTTP/1.1 200 OK\r\n\r\n" if framing == "until the close" else CHUNKED_HEAD
    piece = b"hello" if framing == "until the close" else b"5\r\nhello\r\n"
    server, port = await _streaming_server([piece], head)  # then holds the connection open
    pool = Http1Pool()
    gate = asyncio.get_running_loop().create_future()
    got = []

    async def slow_write():
        await gate

    def write(data, last):
        got.append((data, last))
        return slow_write() if len(got) == 1 else None

    async with server:
        r = await pool.send("POST", f"http://127.0.0.1:{port}/", b"{}")
        relay = asyncio.ensure_future(r.relay(write))
        while not got:
            await asyncio.sleep(0.01)
        r._conn.transport.abort()  # lost while the first write still waits
        await asyncio.sleep(0.05)
        assert not relay.done()
        gate.set_result(None)
        if framing == "until the close":  # the close ends such a body: a last, empty piece
            await asyncio.wait_for(relay, 5)
            assert got == [(b"hello", False), (b"", True)]
        else:  # a chunked body cut short is broken
            with pytest.raises(UpstreamProtocolError, match="closed mid-body"):
                await asyncio.wait_for(relay, 5)
            assert got == [(b"hello", False)]
        await r.aclose()
    await pool.aclose()


async def test_a_relay_broken_by_the_server_or_the_writer_raises_and_drops_the_connection():
    server, port = await _streaming_server([b"3\r\nabc\r\n"], CHUNKED_HEAD, close_after=True)
    pool = Http1Pool()
    async with server:
        r = await pool.send("POST", f"http://127.0.0.1:{port}/", b"{}")
        got = []
        with pytest.raises(UpstreamProtocolError, match="closed mid-body"):
            await r.relay(lambda piece, last: got.append(piece))
        assert got == [b"abc"]
        await r.aclose()
        assert pool._idle.get(("127.0.0.1", port, False), []) == []
    parts = [b"3\r\nabc\r\n", b"3\r\ndef\r\n0\r\n\r\n"]
    server, port = await _streaming_server(parts, CHUNKED_HEAD)
    async with server:
        r = await pool.send("POST", f"http://127.0.0.1:{port}/", b"{}")

        def failing(piece, last):
            raise OSError("client went away")

        with pytest.raises(OSError, match="client went away"):
            await r.relay(failing)
        await r.aclose()
        assert pool._idle.get(("127.0.0.1", port, False), []) == []
    await pool.aclose()


async def test_a_cancelled_relay_writes_nothing_more_and_closes_its_stream():
    server, port, closed = await _endless_stream_server(b"1\r\nx\r\n")
    pool = Http1Pool()
    got = []
    async with server:
        r = await pool.send("POST", f"http://127.0.0.1:{port}/", b"{}")
        relay = asyncio.ensure_future(r.relay(lambda piece, last: got.append(piece)))
        await asyncio.sleep(0.1)
        relay.cancel()
        with pytest.raises(asyncio.CancelledError):
            await relay
        seen = len(got)
        await r.aclose()
        await asyncio.wait_for(closed.wait(), 5)
        await asyncio.sleep(0.05)
        assert seen > 0 and len(got) == seen
    await pool.aclose()


async def test_bytes_after_a_relayed_body_keep_its_connection_from_reuse():
    server, port = await _streaming_server([b"1\r\na\r\n0\r\n\r\nHTTP/1.1"], CHUNKED_HEAD)
    pool = Http1Pool()
    async with server:
        r = await pool.send("POST", f"http://127.0.0.1:{port}/", b"{}")
        got = []
        await r.relay(lambda piece, last: got.append((piece, last)))
        assert got == [(b"a", True)]
        await r.aclose()
        assert pool._idle.get(("127.0.0.1", port, False), []) == []
    await pool.aclose()


async def test_a_response_head_past_the_limit_or_cut_short_is_refused():
    async def huge(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nx: " + b"a" * (80 * 1024) + b"\r\n\r\n")
        await writer.drain()

    async def cut(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-")
        await writer.drain()
        writer.close()

    pool = Http1Pool()
    for handler, match in ((huge, "bad response head"), (cut, "no response")):
        server, port = await raw_server(handler)
        async with server:
            with pytest.raises(UpstreamProtocolError, match=match):
                await pool.send("POST", f"http://127.0.0.1:{port}/", b"{}")
    await pool.aclose()


async def _a_connection_closed_before_the_request_is_written():
    """The upstream's connection ends between its opening and the request's write (a
    sidecar killed as it accepted): an upstream error the callers retry elsewhere, never
    the event loop's own error (uvloop raises RuntimeError on a closed transport)."""

    async def accept(reader, writer):
        await reader.read()

    server, port = await raw_server(accept)
    pool = Http1Pool(connect_timeout=1)
    opened = pool._open

    async def open_then_lose(key):
        conn = await opened(key)
        conn.transport.abort()  # as a reset from the peer would
        await asyncio.sleep(0.01)  # its connection_lost has run
        return conn

    pool._open = open_then_lose
    async with server:
        with pytest.raises(UpstreamProtocolError, match="closed before the request"):
            await pool.send("POST", f"http://127.0.0.1:{port}/v1/completions", b"{}")
    await pool.aclose()


async def test_a_connection_closed_before_the_request_is_written_is_an_upstream_error():
    await _a_connection_closed_before_the_request_is_written()


def test_a_connection_closed_before_the_request_is_written_likewise_on_uvloop():
    uvloop.run(_a_connection_closed_before_the_request_is_written())
