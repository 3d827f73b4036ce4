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
    # Hooks that add kv_transfer_params to final outputs (the connector sets this).
    app.state.final_kv_params = None

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
        if aengine.dead_error:
            return _error(aengine.dead_error, 503, "ServiceUnavailable")
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

    def final_kv_params(out: RequestOutput) -> Optional[dict]:
        hook = app.state.final_kv_params
        return hook(out) if hook is not None else out.kv_transfer_params

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

    # --- /v1/completions --------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(http_req: Request):
        req = await parse(http_req, CompletionRequest)
        try:
            prompt = req.prompt_input()
        except ValueError as exc:
            raise ApiError(str(exc), param="prompt")
        prompt_ids = tokenize_prompt(prompt)
        request_id, first, stream = await start(http_req, req, prompt_ids)
        created, rid = int(time.time()), f"cmpl-{request_id}"
        if not req.stream:
            text, last, _ = await run_to_end(http_req, first, stream)
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": last.finish_reason, "stop_reason": None}],
                    "usage": usage_dict(last.num_prompt_tokens, last.num_output_tokens,
                                        last.num_cached_tokens),
                    "kv_transfer_params": final_kv_params(last)}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events():
            try:
                async for out in outputs(first, stream, http_req.state.t_arrival):
                    chunk = {"id": rid, "object": "text_completion", "created": created,
                             "model": model_name,
                             "choices": [{"index": 0, "text": out.new_text, "logprobs": None,
                                          "finish_reason": out.finish_reason}]}
                    if out.finished:
                        chunk["kv_transfer_params"] = final_kv_params(out)
                    yield sse(chunk)
                    if out.finished and include_usage:
                        yield sse({"id": rid, "object": "text_completion", "created": created,
                                   "model": model_name, "choices": [],
                                   "usage": usage_dict(out.num_prompt_tokens,
                                                       out.num_output_tokens,
                                                       out.num_cached_tokens)})
                yield "data: [DONE]\n\n"
            finally:
                await stream.aclose()
        return StreamingResponse(events(), media_type="text/event-stream")

    # --- /v1/chat/completions ---------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(http_req: Request):
        req = await parse(http_req, ChatCompletionRequest)
        prompt_ids = tokenize_chat(req)
        request_id, first, stream = await start(http_req, req, prompt_ids)
        created, rid = int(time.time()), f"chatcmpl-{request_id}"
        if not req.stream:
            text, last, _ = await run_to_end(http_req, first, stream)
            return {"id": rid, "object": "chat.completion", "created": created,
                    "model": model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": last.finish_reason,
                                 "stop_reason": None}],
                    "usage": usage_dict(last.num_prompt_tokens, last.num_output_tokens,
                                        last.num_cached_tokens),
                    "kv_transfer_params": final_kv_params(last)}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: dict, finish_reason=None, **extra) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": finish_reason}], **extra}

        async def events():
            try:
                yield sse(chunk({"role": "assistant", "content": ""}))
                async for out in outputs(first, stream, http_req.state.t_arrival):
                    extra = {"kv_transfer_params": final_kv_params(out)} if out.finished else {}
                    delta = {"content": out.new_text} if out.new_text or not out.finished else {}
                    yield sse(chunk(delta, out.finish_reason, **extra))
                    if out.finished and include_usage:
                        yield sse({"id": rid, "object": "chat.completion.chunk",
                                   "created": created, "model": model_name, "choices": [],
                                   "usage": usage_dict(out.num_prompt_tokens,
                                                       out.num_output_tokens,
                                                       out.num_cached_tokens)})
                yield "data: [DONE]\n\n"
            finally:
                await stream.aclose()
        return StreamingResponse(events(), media_type="text/event-stream")

    return app
