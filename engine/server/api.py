"""The OpenAI-compatible HTTP routes of one engine."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdpool.engine.async_engine import AsyncEngine
from pdpool.engine.engine_core import RequestOutput, RequestRejected
from pdpool.engine.server.metrics import EngineMetrics
from pdpool.engine.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                           error_body, usage_dict)

log = logging.getLogger("pdpool.server")


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError",
                 param: Optional[str] = None):
        super().__init__(message)
        self.status, self.err_type, self.param = status, err_type, param


def _error(message: str, status: int = 400, err_type: str = "BadRequestError",
           param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, status, param), status_code=status)


def _validation_message(exc) -> str:
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts) or "invalid request"


def build_app(aengine: AsyncEngine) -> FastAPI:
    engine = aengine.engine
    model_name = engine.model_name
    metrics = EngineMetrics(engine, model_name)
    app = FastAPI(title="pdpool engine")
    app.state.aengine = aengine
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_req, exc: RequestValidationError):
        return _error(_validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_req, exc: StarletteHTTPException):
        return _error(str(exc.detail), exc.status_code,
                      "NotFoundError" if exc.status_code == 404 else "BadRequestError")

    @app.exception_handler(ApiError)
    async def _on_api(_req, exc: ApiError):
        return _error(str(exc), exc.status, exc.err_type, exc.param)

    @app.exception_handler(Exception)
    async def _on_any(_req, exc: Exception):
        log.exception("unhandled error")
        return _error(f"internal error: {exc}", 500, "InternalServerError")

    @app.get("/health")
    async def health():
        if not aengine.alive:
            return _error("the engine loop has stopped", 503, "ServiceUnavailable")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()),
            "owned_by": "pdpool", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def parse(request: Request, cls):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError("the request body is not valid JSON")
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        try:
            req = cls.model_validate(body)
        except ValidationError as exc:
            raise ApiError(_validation_message(exc))
        if req.model is not None and req.model != model_name:
            raise ApiError(f"the model `{req.model}` does not exist", 404, "NotFoundError",
                           "model")
        return req

    def tokenize_prompt(prompt) -> list[int]:
        if isinstance(prompt, str):
            return engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return list(prompt)

    def tokenize_chat(req: ChatCompletionRequest) -> list[int]:
        if not req.messages:
            raise ApiError("messages must not be empty", param="messages")
        try:
            msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as exc:
            raise ApiError(str(exc), param="messages")
        text = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                    tokenize=False)
        return engine.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def start(http_req: Request, req, prompt_ids: list[int]):
        """Validates and submits; returns the request id and its output iterator."""
        try:
            params = req.sampling_params(default_max_tokens=16)
        except ValueError as exc:
            raise ApiError(str(exc))
        request_id = http_req.headers.get("x-request-id") or uuid.uuid4().hex
        request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        kv_params = req.kv_params_dict()
        http_req.state.t_arrival = time.monotonic()

        def add():
            engine.add_request(request_id, prompt_ids, params, cache_salt=req.cache_salt,
                               cache_hit_threshold=req.cache_hit_threshold,
                               kv_transfer_params=kv_params)
        stream = aengine.generate(request_id, add)
        # Pull the first item now so that validation errors become a 400 before any bytes.
        try:
            first = await stream.__anext__()
        except (RequestRejected, ValueError) as exc:
            raise ApiError(str(exc))
        except RuntimeError as exc:
            raise ApiError(str(exc), 500, "InternalServerError")
        if first.finish_reason == "error":
            # e.g. a failed KV transfer under --kv-load-failure-policy fail: retryable.
            raise ApiError(first.error or "the request failed", 503, "KVTransferError")
        return request_id, first, stream

    async def outputs(first: RequestOutput, stream, t_arrival: float
                      ) -> AsyncIterator[RequestOutput]:
        t_last, n = t_arrival, 0
        out = first
        while True:
            now = time.monotonic()
            metrics.observe_output(out, n == 0, now - t_last)
            t_last, n = now, n + 1
            yield out
            if out.finished:
                return
            out = await stream.__anext__()

    async def run_to_end(http_req: Request, first, stream) -> tuple[str, RequestOutput, list[int]]:
        """Collects a non-streaming answer; a client that goes away aborts it."""
        text, tokens, last = [], [], first

        async def collect():
            nonlocal last
            async for out in outputs(first, stream, http_req.state.t_arrival):
                text.append(out.new_text)
                tokens.extend(out.new_token_ids)
                last = out

        task = asyncio.ensure_future(collect())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await http_req.is_disconnected():
                task.cancel()
                await stream.aclose()
                raise ApiError("client disconnected", 499, "ClientClosedRequest")
        task.result()
        return "".join(text), last, tokens

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def answer(http_req: Request, req, prompt_ids: list[int], id_prefix: str,
                     objects: tuple[str, str], full_choice, chunk_choice, opening=None):
        """One answer in OpenAI's shape: a whole response, or an SSE stream whose final
        chunk carries kv_transfer_params (and a usage chunk when asked for)."""
        request_id, first, stream = await start(http_req, req, prompt_ids)
        created, rid = int(time.time()), f"{id_prefix}-{request_id}"

        def base(obj: str) -> dict:
            return {"id": rid, "object": obj, "created": created, "model": model_name}

        def usage(out: RequestOutput) -> dict:
            return usage_dict(out.num_prompt_tokens, out.num_output_tokens,
                              out.num_cached_tokens)

        if not req.stream:
            text, last, _ = await run_to_end(http_req, first, stream)
            return {**base(objects[0]), "choices": [full_choice(text, last.finish_reason)],
                    "usage": usage(last), "kv_transfer_params": last.kv_transfer_params}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events():
            try:
                if opening is not None:
                    yield sse({**base(objects[1]), "choices": [opening]})
                async for out in outputs(first, stream, http_req.state.t_arrival):
                    chunk = {**base(objects[1]), "choices": [chunk_choice(out)]}
                    if out.finished:
                        chunk["kv_transfer_params"] = out.kv_transfer_params
                    yield sse(chunk)
                    if out.finished and include_usage:
                        yield sse({**base(objects[1]), "choices": [], "usage": usage(out)})
                yield "data: [DONE]\n\n"
            finally:
                await stream.aclose()
        return StreamingResponse(events(), media_type="text/event-stream")

    # --- /v1/completions --------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(http_req: Request):
        req = await parse(http_req, CompletionRequest)
        try:
            prompt = req.prompt_input()
        except ValueError as exc:
            raise ApiError(str(exc), param="prompt")
        return await answer(
            http_req, req, tokenize_prompt(prompt), "cmpl",
            ("text_completion", "text_completion"),
            lambda text, reason: {"index": 0, "text": text, "logprobs": None,
                                  "finish_reason": reason, "stop_reason": None},
            lambda out: {"index": 0, "text": out.new_text, "logprobs": None,
                         "finish_reason": out.finish_reason})

    # --- /v1/chat/completions ---------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(http_req: Request):
        req = await parse(http_req, ChatCompletionRequest)

        def delta(out: RequestOutput) -> dict:
            content = {"content": out.new_text} if out.new_text or not out.finished else {}
            return {"index": 0, "delta": content, "logprobs": None,
                    "finish_reason": out.finish_reason}
        return await answer(
            http_req, req, tokenize_chat(req), "chatcmpl",
            ("chat.completion", "chat.completion.chunk"),
            lambda text, reason: {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": reason,
                                  "stop_reason": None},
            delta,
            opening={"index": 0, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None})

    return app
