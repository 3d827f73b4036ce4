"""Small ASGI helpers shared by the sidecar and the gateway.

Both are plain ASGI apps rather than framework routes: a proxy needs to own the moment a
response starts (decode-first decides only after the first chunk) and to notice a client
that goes away while nothing is being sent, and the hot path stays a few function calls.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable, Iterable, Optional, cast

from pdpool.body_budget import RETRY_AFTER_S, BodiesBusy, BodyHold
from pdpool.protocol import DEFAULT_MAX_BODY_BYTES

# ASGI messages and scopes are plain dicts of str keys (the ASGI spec's JSON-like shape).
Message = dict[str, Any]
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MAX_BODY_BYTES = DEFAULT_MAX_BODY_BYTES
# Hop-by-hop headers and those a proxy must recompute never travel between legs.
HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "accept-encoding",
        "content-encoding",
    }
)


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    """The client disconnected while its request body was still arriving."""


async def read_body(
    receive: Receive,
    limit: int = MAX_BODY_BYTES,
    scope: Optional[Scope] = None,
    hold: Optional[BodyHold] = None,
) -> bytes:
    """The request body; BodyTooLarge as soon as it passes `limit` (an announced
    content-length already, so a huge body is never read). With `hold`, a large body draws
    on its process's budget as it arrives (BodiesBusy when that has no room); the caller
    releases the hold when the request ends."""
    if scope is not None:
        _check_announced(scope, limit, hold)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge()
        if hold is not None:
            hold.grow_to(size)
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _check_announced(scope: Scope, limit: int, hold: Optional[BodyHold]) -> None:
    """Refuses a body by its content-length before any of it is read."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length" and value.isdigit():
            if int(value) > limit:
                raise BodyTooLarge()
            if hold is not None:
                hold.grow_to(int(value))


# Bodies up to this size are parsed on the event loop; larger ones in a worker thread, so
# that a big (or hostile: a million tiny lists) body never holds up other streams or probes.
INLINE_PARSE_BYTES = 64 * 1024


async def off_loop_if_large(fn: Callable[..., Any], raw: bytes, *args: Any) -> Any:
    """fn(raw, *args), in a worker thread when `raw` is large."""
    if len(raw) <= INLINE_PARSE_BYTES:
        return fn(raw, *args)
    return await asyncio.to_thread(fn, raw, *args)


async def serve_lifespan(
    receive: Receive,
    send: Send,
    startup: Callable[[], Awaitable[None]],
    shutdown: Callable[[], Awaitable[None]],
) -> None:
    """ASGI lifespan: `startup` before the first request (a failure is reported to the
    server, which then exits with it), `shutdown` at the end."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                await startup()
            except Exception as exc:  # reported to the server
                await send({"type": "lifespan.startup.failed", "message": str(exc)})
                return
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return


def header_dict(scope: Scope) -> dict[str, str]:
    """Request headers, lower-cased names (the last value wins)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def forwardable(headers: dict[str, str], drop: Iterable[str] = ()) -> dict[str, str]:
    dropped = HOP_HEADERS.union(drop)
    out = {k: v for k, v in headers.items() if k not in dropped}
    # Our legs parse upstream bodies: ask for them uncompressed.
    out["accept-encoding"] = "identity"
    return out


def raw_headers(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """Headers as octets (as they came: latin-1), for ASGI and for httpx, which would
    encode a str value as ASCII and fail on any other octet."""
    return [(k.encode("latin-1"), str(v).encode("latin-1")) for k, v in headers.items()]


async def send_start(send: Send, status: int, headers: dict[str, str]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": raw_headers(headers)})


def send_now(send: Send, message: Message) -> Optional[Awaitable[None]]:
    """Sends `message` from a plain callback, outside any task: None once sent, which is at
    once whenever the server can take it without waiting (uvicorn writes a body part
    straight to its socket unless the client has stopped reading); else an awaitable that
    completes the send."""
    step: Any = send(message)
    if not asyncio.iscoroutine(step):
        return cast(Awaitable[None], step)  # another kind of awaitable: awaited as it is
    try:
        waiting_on = step.send(None)
    except StopIteration:
        return None
    return _finish_send(step, waiting_on)


def send_piece(send: Send, body: bytes, last: bool) -> Optional[Awaitable[None]]:
    """A relayed body's piece as the answer's next body part (`send_now`), the last one
    ending the answer; an empty piece that is not the last sends nothing."""
    if body or last:
        return send_now(send, {"type": "http.response.body", "body": body, "more_body": not last})
    return None


async def _finish_send(step: Any, waiting_on: Any) -> None:
    """Runs a started send to its end: each time it waits (on a future, or a bare yield for
    one turn of the loop), this waits too, then resumes it."""
    try:
        while True:
            if waiting_on is None:
                await asyncio.sleep(0)
            elif asyncio.isfuture(waiting_on):
                await asyncio.wait((waiting_on,))  # its outcome is the send's to raise
            else:
                raise RuntimeError(f"an ASGI send waited on {waiting_on!r}")
            waiting_on = step.send(None)
    except StopIteration:
        return
    finally:
        step.close()  # when cancelled or failed part-way: no "never awaited" warnings


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    headers: Optional[dict[str, str]] = None,
    content_type: str = "application/json",
) -> None:
    all_headers = {"content-type": content_type, **(headers or {})}
    all_headers["content-length"] = str(len(body))
    await send_start(send, status, all_headers)
    await send({"type": "http.response.body", "body": body, "more_body": False})


def error_body(
    status: int, message: str, param: Optional[str] = None, code: Optional[str] = None
) -> dict[str, Any]:
    """OpenAI's error shape."""
    if status < 500:
        kind = {
            401: "authentication_error",
            403: "permission_error",
            404: "not_found_error",
            429: "rate_limit_error",
        }.get(status, "invalid_request_error")
    else:
        kind = "service_unavailable_error" if status in (502, 503, 504) else "server_error"
    return {
        "error": {
            "message": message,
            "type": kind,
            "param": param,
            "code": code if code is not None else status,
        }
    }


async def send_error(
    send: Send,
    status: int,
    message: str,
    param: Optional[str] = None,
    code: Optional[str] = None,
    headers: Optional[dict[str, str]] = None,
) -> None:
    body = json.dumps(error_body(status, message, param, code)).encode()
    await send_bytes(send, status, body, headers)


async def send_bodies_busy(
    send: Send, exc: BodiesBusy, headers: Optional[dict[str, str]] = None
) -> None:
    """The answer to a body refused by its process's budget of large bodies: retryable."""
    retry = {"retry-after": RETRY_AFTER_S, **(headers or {})}
    await send_error(send, 503, str(exc), code="bodies_busy", headers=retry)


def sse_error_event(status: int, message: str) -> bytes:
    """An error inside an already started stream (what vLLM sends in that case)."""
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\n"


DISCONNECT_GRACE_TURNS = 2


async def run_until_disconnect(flow: Awaitable[None], receive: Receive) -> bool:
    """Runs `flow` while watching for the client to disconnect; a disconnect cancels the
    flow, which closes its upstream connections so the engines abort their work.

    The flow runs in the caller's task, so it reaches its first upstream write in the turn
    of the loop that read the request: only the watcher is a task of its own (it starts a
    turn later, when the upstream already has the request). Returns True when the client
    disconnected first."""
    task = asyncio.current_task()
    assert task is not None, "called from a task (an ASGI request's)"
    gone = False

    async def watch() -> None:
        nonlocal gone
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        # receive() says the same once the answer is complete, while the flow may still be
        # ending (closing its upstream leg, counting what it did): a flow that ends within
        # these turns is not cancelled.
        for _ in range(DISCONNECT_GRACE_TURNS):
            await asyncio.sleep(0)
        gone = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        await flow
    except asyncio.CancelledError:
        # Only the watcher's cancellation ends here; any other (a server shutting down)
        # goes on up.
        if not gone or _cancel_requests(task) > 1:
            raise
        _uncancel(task)
        return True
    finally:
        watcher.cancel()
    if gone:  # the flow swallowed the watcher's cancellation: clear it all the same
        _uncancel(task)
    return gone


def _cancel_requests(task: "asyncio.Task[Any]") -> int:
    """Cancellations requested of `task` and not withdrawn (Python 3.11+ counts them; on
    3.10, one)."""
    cancelling = getattr(task, "cancelling", None)
    return cancelling() if cancelling is not None else 1


def _uncancel(task: "asyncio.Task[Any]") -> None:
    """Withdraws one cancellation request, so that the task's later awaits (and
    asyncio.timeout) behave as if it had not been cancelled (a no-op before 3.11)."""
    uncancel = getattr(task, "uncancel", None)
    if uncancel is not None:
        uncancel()
