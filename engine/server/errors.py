"""OpenAI-shaped errors of the HTTP layer: the exception routes raise, and the app's handlers
that write every failure (ours, FastAPI's, Starlette's, unexpected ones) as one JSON body."""

from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdpool.engine.outputs import (
    EngineBusy,
    EngineUnavailable,
    KVTransferRefused,
    RequestOutput,
    RequestRejected,
)
from pdpool.engine.server.protocol import error_body

log = logging.getLogger("pdpool.server")


class ApiError(Exception):
    """An OpenAI error answer, raised from anywhere below a route."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        err_type: str = "BadRequestError",
        param: Optional[str] = None,
    ):
        super().__init__(message)
        self.status, self.err_type, self.param = status, err_type, param


RETRY_AFTER_S = "1"


def error_response(
    message: str, status: int = 400, err_type: str = "BadRequestError", param: Optional[str] = None
) -> JSONResponse:
    # A 503 is retryable (the engine core restarts, a KV handoff failed): say when to retry.
    headers = {"Retry-After": RETRY_AFTER_S} if status == 503 else None
    return JSONResponse(
        error_body(message, err_type, status, param), status_code=status, headers=headers
    )


def client_closed() -> ApiError:
    """The answer to a client that went away (nobody reads it; logs and metrics do)."""
    return ApiError("client disconnected", 499, "ClientClosedRequest")


def output_error(out: RequestOutput) -> ApiError:
    """A request that ended with an error: 400 for its own bad parameters, 500 for an
    engine fault, 503 (retryable) for a failed KV transfer."""
    status = out.error_status or 503  # no status: a failed KV load (fail policy)
    err_type = {400: "BadRequestError", 500: "InternalServerError"}.get(status, "KVTransferError")
    return ApiError(out.error or "the request failed", status, err_type)


def engine_error(exc: Exception) -> ApiError:
    """The answer to an exception a request's engine stream raised: the request's own fault
    (400), an untrusted KV handoff or an engine core that is gone (503, retryable), else 500.
    One mapping for a failure before the first token, after it, or in a stream."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, (RequestRejected, ValueError)):
        return ApiError(str(exc))
    if isinstance(exc, KVTransferRefused):
        return ApiError(str(exc), 503, "KVTransferError", param="kv_transfer_params")
    if isinstance(exc, (EngineUnavailable, EngineBusy)):
        return ApiError(str(exc), 503, "ServiceUnavailable")
    return ApiError(str(exc), 500, "InternalServerError")


def validation_message(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(_req: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(
            str(exc.detail),
            exc.status_code,
            "NotFoundError" if exc.status_code == 404 else "BadRequestError",
        )

    @app.exception_handler(ApiError)
    async def _on_api(_req: Request, exc: ApiError) -> JSONResponse:
        return error_response(str(exc), exc.status, exc.err_type, exc.param)

    @app.exception_handler(EngineUnavailable)
    @app.exception_handler(EngineBusy)
    async def _on_engine_gone(_req: Request, exc: Exception) -> JSONResponse:
        # Any route that waits on the engine core (a lease release, a tokenization) while
        # the core restarts: retryable, like the generation routes' answer (engine_error).
        return error_response(str(exc), 503, "ServiceUnavailable")

    @app.exception_handler(Exception)
    async def _on_any(_req: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(f"internal error: {exc}", 500, "InternalServerError")
