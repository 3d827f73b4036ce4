"""The lean HTTP/1.1 client of the hot path, against raw asyncio servers."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdpool.sidecar.http1 import Http1Pool, UpstreamConnectError, UpstreamProtocolError


async def raw_server(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def read_request(reader):
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = int([h for h in lines if h.lower().startswith(b"content-length")][0].split(b":")[1])
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
        assert [c async for c in r.aiter_raw()] == [b"hello", b" ", b"world"]
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
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


async def test_closing_an_unfinished_stream_closes_the_connection():
    closed = asyncio.Event()

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            while True:
                writer.write(b"3\r\nabc\r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            closed.set()

    server, port = await raw_server(handler)
    pool = Http1Pool()
    async with server:
        r = await pool.send("POST", f"http://127.0.0.1:{port}/", b"{}")
        async for chunk in r.aiter_raw():
            assert chunk == b"abc"
            break
        await r.aclose()
        await asyncio.wait_for(closed.wait(), 5)
    assert pool._idle.get(("127.0.0.1", port), []) == []
