"""The OpenAI-compatible HTTP routes of one engine."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pdpool.engine.async_engine import AsyncEngine
from pdpool.engine.engine_core import KVTransferRefused, RequestOutput, RequestRejected
from pdpool.engine.server.logprobs import (TokenText, chat_formatter, completion_formatter,
                                           merge_chat, merge_completion)
from pdpool.engine.server.metrics import EngineMetrics
from pdpool.engine.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                           error_body, message_text, usage_dict)
from pdpool.protocol import RequestError, parse_json_body, validate_request

log = logging.getLogger("pdpool.server")

# At most this many choices (prompts x n) in one request: each is an engine request.
MAX_CHOICES = 64


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

    max_body = engine.config.max_body_bytes
    # CPU-heavy request preparation (JSON, validation, chat template, tokenization) runs
    # here, never on the event loop: /health and streams stay responsive meanwhile.
    prep_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prepare")
    app.state.prep_pool = prep_pool

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(prep_pool, fn, *args)

    @app.get("/health")
    async def health():
        """Liveness: the process and its engine thread are alive."""
        if not aengine.alive:
            return _error("the engine loop has stopped", 503, "ServiceUnavailable")
        if engine.fault is not None:   # every request failed in the model: not hidden
            return _error(f"engine failure: {engine.fault}", 503, "ServiceUnavailable")
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        """Readiness: as /health, and the engine loop has ticked within
        --ready-max-stall-s while it has work (a wedged step is not ready)."""
        problem = aengine.readiness(engine.config.ready_max_stall_s)
        if problem is None and engine.fault is not None:
            problem = f"engine failure: {engine.fault}"
        if problem is not None:
            return _error(problem, 503, "ServiceUnavailable")
        return {"status": "ready"}

    @app.post("/pdpool/v1/kv/release")
    async def release_kv(request: Request):
        """Ends a KV lease this engine granted, named by the kv_transfer_params it issued
        (a router whose prefill leg did not pull decode's prefix gives it back at once)."""
        try:
            body = parse_json_body(await read_body(request))
        except RequestError:
            body = None
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if not isinstance(params, dict):
            return _error("kv_transfer_params (an object) is required", 400,
                          param="kv_transfer_params")
        # Thread-safe: it only marks the lease; the engine thread gives the blocks back.
        return {"released": engine.connector.release_lease(params)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()),
            "owned_by": "pdpool", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def read_body(request: Request) -> bytes:
        """The body, refused with 413 as soon as it passes --max-body-bytes (announced or
        while it arrives: a huge body is never buffered)."""
        too_large = ApiError(f"the request body exceeds {max_body} bytes (--max-body-bytes)",
                             413)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body:
            raise too_large
        parts, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body:
                    raise too_large
                parts.append(chunk)
        except ClientDisconnect:
            metrics.client_disconnects.labels(phase="body", **metrics.labels).inc()
            raise ApiError("client disconnected", 499, "ClientClosedRequest")
        return b"".join(parts)

    def vocab_check(req) -> None:
        vocab = engine.info.config["vocab_size"]
        for t in req.stop_token_ids or ():
            if t >= vocab:
                raise RequestError(f"stop_token_ids must be in [0, {vocab}), got {t}",
                                   "stop_token_ids")

    async def parse(request: Request, cls):
        raw = await read_body(request)

        def decode():
            req = validate_request(parse_json_body(raw), cls)
            vocab_check(req)
            return req
        try:
            req = await off_loop(decode)
        except RequestError as exc:
            raise ApiError(str(exc), exc.status, param=exc.param)
        if req.model is not None and req.model != model_name:
            raise ApiError(f"the model `{req.model}` does not exist", 404, "NotFoundError",
                           "model")
        return req

    def tokenize_prompt(prompt) -> list[int]:
        if isinstance(prompt, str):
            return engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return list(prompt)

    def tokenize_chat(req: ChatCompletionRequest) -> list[int]:
        msgs = [{"role": m.role, "content": message_text(m)} for m in req.messages]
        text = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                    tokenize=False)
        return engine.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def until_disconnect(http_req: Request, work):
        """Awaits `work` (preparation, or the first outputs: a request that waits in the
        queue or prefills) unless the client goes away first: then `work` is cancelled,
        which aborts its engine requests (a queued one is never computed), and the
        disconnect is counted. Call only once the body has been read."""
        task = asyncio.ensure_future(work)

        async def disconnected():
            while (await http_req.receive())["type"] != "http.disconnect":
                pass
        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                if watcher.done() and not watcher.cancelled():
                    metrics.client_disconnects.labels(phase="waiting", **metrics.labels).inc()
                    raise ApiError("client disconnected", 499, "ClientClosedRequest")
        return task.result()

    def submit(http_req: Request, req, prompt_ids: list[int], params):
        """One engine request: its id and its output iterator (the request is added when
        the iterator is first awaited)."""
        request_id = http_req.headers.get("x-request-id") or uuid.uuid4().hex
        request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        kv_params = req.kv_params_dict()

        def add():
            engine.add_request(request_id, prompt_ids, params, cache_salt=req.cache_salt,
                               cache_hit_threshold=req.cache_hit_threshold,
                               kv_transfer_params=kv_params)
        return request_id, aengine.generate(request_id, add)

    async def first_output(stream) -> RequestOutput:
        """Pulls the first output so that validation errors become a 400 (or the error's
        own status) before any bytes."""
        try:
            first = await stream.__anext__()
        except (RequestRejected, ValueError) as exc:
            raise ApiError(str(exc))
        except KVTransferRefused as exc:
            raise ApiError(str(exc), 503, "KVTransferError", param="kv_transfer_params")
        except RuntimeError as exc:
            raise ApiError(str(exc), 500, "InternalServerError")
        if first.finish_reason == "error":
            raise output_error(first)
        return first

    def output_error(out: RequestOutput) -> ApiError:
        """A request that ended with an error: 400 for its own bad parameters, 500 for an
        engine fault, 503 (retryable) for a failed KV transfer."""
        status = out.error_status or 503   # no status: a failed KV load (fail policy)
        err_type = {400: "BadRequestError", 500: "InternalServerError"}.get(
            status, "KVTransferError")
        return ApiError(out.error or "the request failed", status, err_type)

    async def outputs(first: RequestOutput, stream, t_arrival: float
                      ) -> AsyncIterator[RequestOutput]:
        t_last, n = t_arrival, 0
        out = first
        while True:
            now = time.monotonic()
            metrics.observe_output(out, n == 0, now - t_last, now - t_arrival)
            t_last, n = now, n + 1
            yield out
            if out.finished:
                return
            out = await stream.__anext__()

    class Choice:
        """One engine request behind one choice of the answer."""

        def __init__(self, index: int, first_of_prompt: bool, request_id: str, first, stream,
                     fmt):
            self.index, self.first_of_prompt = index, first_of_prompt
            self.request_id = request_id
            self.first, self.stream, self.fmt = first, stream, fmt
            self.text: list[str] = []
            self.logprobs: list[dict] = []
            self.last: RequestOutput = first

    async def start_choices(http_req: Request, req, prompts: list[list[int]], new_fmt
                            ) -> list[Choice]:
        """n choices per prompt, index = prompt_index * n + i, each its own engine request.
        With a seed, choice i of every prompt samples with seed + i (as vLLM v1), so a
        choice equals a single request sent with that seed."""
        try:
            params = req.sampling_params(default_max_tokens=16)
        except ValueError as exc:
            raise ApiError(str(exc))
        n = params.n
        if len(prompts) * n > MAX_CHOICES:
            raise ApiError(f"n x the number of prompts must be at most {MAX_CHOICES}, got "
                           f"{len(prompts) * n}", param="n")
        if len(prompts) * n > 1 and req.kv_transfer_params is not None:
            raise ApiError("kv_transfer_params: only with one prompt and n=1",
                           param="kv_transfer_params")
        http_req.state.t_arrival = time.monotonic()
        subs = []
        for p, prompt_ids in enumerate(prompts):
            for i in range(n):
                child = dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else params.seed + i)
                subs.append((p * n + i, i == 0, *submit(http_req, req, prompt_ids, child)))
        try:   # all at once, so that they share steps
            firsts = await asyncio.gather(*(first_output(s[3]) for s in subs),
                                          return_exceptions=True)
            failed = [f for f in firsts if isinstance(f, BaseException)]
            if failed:
                raise failed[0]
        except BaseException:
            for s in subs:
                await s[3].aclose()
            raise
        return [Choice(index, first_of_prompt, request_id, first, stream,
                       new_fmt() if new_fmt else None)
                for (index, first_of_prompt, request_id, stream), first in zip(subs, firsts)]

    def absorb(c: Choice, out: RequestOutput) -> Optional[dict]:
        """Records one output of a choice; returns the logprobs of its tokens, if asked."""
        c.last = out
        c.text.append(out.new_text)
        if c.fmt is None or not out.logprobs:
            return None
        lp = c.fmt(out.logprobs)
        c.logprobs.append(lp)
        return lp

    def usage_of(choices: list[Choice]) -> dict:
        # As vLLM: each prompt's tokens count once, every choice's completion tokens count.
        firsts = [c.last for c in choices if c.first_of_prompt]
        return usage_dict(sum(o.num_prompt_tokens for o in firsts),
                          sum(c.last.num_output_tokens for c in choices),
                          sum(o.num_cached_tokens for o in firsts),
                          sum(o.num_pulled_tokens for o in firsts))

    async def close_all(choices: list[Choice], tasks: list[asyncio.Future]) -> None:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in choices:
            await c.stream.aclose()   # aborts the ones still running

    async def run_to_end(http_req: Request, choices: list[Choice]) -> None:
        """Collects a non-streaming answer; a client that goes away aborts it."""
        async def collect(c: Choice):
            async for out in outputs(c.first, c.stream, http_req.state.t_arrival):
                absorb(c, out)
                if out.finish_reason == "error":
                    raise output_error(out)

        tasks = [asyncio.ensure_future(collect(c)) for c in choices]
        try:
            while True:
                done, pending = await asyncio.wait(tasks, timeout=0.5,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    if t.exception() is not None:
                        raise t.exception()
                if not pending:
                    return
                if await http_req.is_disconnected():
                    metrics.client_disconnects.labels(phase="running", **metrics.labels).inc()
                    raise ApiError("client disconnected", 499, "ClientClosedRequest")
        finally:
            await close_all(choices, tasks)

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def answer(http_req: Request, req, prompts: list[list[int]], id_prefix: str,
                     objects: tuple[str, str], full_choice, chunk_choice, opening=None,
                     new_fmt=None, merge_lp=None):
        """One answer in OpenAI's shape: a whole response, or an SSE stream whose final
        chunk carries kv_transfer_params (and a usage chunk when asked for). An error that
        ends a choice is the answer's HTTP error, or an error event in the stream."""
        choices = await until_disconnect(http_req, start_choices(http_req, req, prompts,
                                                                 new_fmt))
        created = int(time.time())
        rid = f"{id_prefix}-{choices[0].request_id}"
        single = len(choices) == 1

        def base(obj: str) -> dict:
            return {"id": rid, "object": obj, "created": created, "model": model_name}

        if not req.stream:
            await run_to_end(http_req, choices)
            return {**base(objects[0]),
                    "choices": [full_choice(c.index, "".join(c.text), c.last.finish_reason,
                                            merge_lp(c.logprobs) if merge_lp else None)
                                for c in choices],
                    "usage": usage_of(choices),
                    "kv_transfer_params": choices[0].last.kv_transfer_params if single
                    else None}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        per_prompt = max(len(choices) // max(len(prompts), 1), 1)
        ids_sent: set[int] = set()

        def with_ids(chunk: dict, c: Choice, out: Optional[RequestOutput]) -> dict:
            """vLLM's return_token_ids: a choice's prompt ids once (chat: at the top of its
            opening chunk), then its new token ids in each chunk. The gateway uses them to
            continue a broken stream exactly (request migration)."""
            if not req.return_token_ids:
                return chunk
            holder = chunk if out is None else chunk["choices"][0]
            if out is not None:
                holder["token_ids"] = out.new_token_ids
            if c.index not in ids_sent:
                ids_sent.add(c.index)
                holder["prompt_token_ids"] = prompts[c.index // per_prompt]
            return chunk

        async def events():
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(c: Choice):
                try:
                    async for out in outputs(c.first, c.stream, http_req.state.t_arrival):
                        queue.put_nowait((c, out))
                except Exception as exc:
                    queue.put_nowait((c, exc))

            tasks = [asyncio.ensure_future(pump(c)) for c in choices]
            ended = False
            try:
                if opening is not None:
                    for c in choices:
                        yield sse(with_ids({**base(objects[1]), "choices": [opening(c.index)]},
                                           c, None))
                remaining = len(choices)
                while remaining:
                    c, out = await queue.get()
                    if isinstance(out, Exception) or out.finish_reason == "error":
                        err = output_error(out) if isinstance(out, RequestOutput) else \
                            ApiError(str(out), 500, "InternalServerError")
                        yield sse(error_body(str(err), err.err_type, err.status))
                        break
                    lp = absorb(c, out)
                    chunk = with_ids({**base(objects[1]),
                                      "choices": [chunk_choice(c.index, out, lp)]}, c, out)
                    if out.finished:
                        remaining -= 1
                        if single:
                            chunk["kv_transfer_params"] = out.kv_transfer_params
                    yield sse(chunk)
                if not remaining and include_usage:
                    yield sse({**base(objects[1]), "choices": [], "usage": usage_of(choices)})
                yield "data: [DONE]\n\n"
                ended = True
            finally:
                if not ended:   # the client went away mid-stream
                    metrics.client_disconnects.labels(phase="running", **metrics.labels).inc()
                await close_all(choices, tasks)
        return StreamingResponse(events(), media_type="text/event-stream")

    # --- /v1/completions --------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(http_req: Request):
        req = await parse(http_req, CompletionRequest)
        try:
            prompts = req.prompt_inputs()
        except ValueError as exc:
            raise ApiError(str(exc), param="prompt")
        text_of = TokenText(engine.tokenizer, req.return_tokens_as_token_ids)
        prompt_ids = await until_disconnect(
            http_req, off_loop(lambda: [tokenize_prompt(p) for p in prompts]))
        return await answer(
            http_req, req, prompt_ids, "cmpl",
            ("text_completion", "text_completion"),
            lambda index, text, reason, lp: {"index": index, "text": text, "logprobs": lp,
                                             "finish_reason": reason, "stop_reason": None},
            lambda index, out, lp: {"index": index, "text": out.new_text, "logprobs": lp,
                                    "finish_reason": out.finish_reason},
            new_fmt=lambda: completion_formatter(text_of), merge_lp=merge_completion)

    # --- /v1/chat/completions ---------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(http_req: Request):
        req = await parse(http_req, ChatCompletionRequest)
        text_of = TokenText(engine.tokenizer, req.return_tokens_as_token_ids)

        def delta(index: int, out: RequestOutput, lp: Optional[dict]) -> dict:
            content = {"content": out.new_text} if out.new_text or not out.finished else {}
            return {"index": index, "delta": content, "logprobs": lp,
                    "finish_reason": out.finish_reason}
        prompt_ids = await until_disconnect(http_req, off_loop(tokenize_chat, req))
        return await answer(
            http_req, req, [prompt_ids], "chatcmpl",
            ("chat.completion", "chat.completion.chunk"),
            lambda index, text, reason, lp: {
                "index": index, "message": {"role": "assistant", "content": text},
                "logprobs": lp, "finish_reason": reason, "stop_reason": None},
            delta,
            opening=lambda index: {"index": index,
                                   "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None},
            new_fmt=lambda: chat_formatter(text_of), merge_lp=merge_chat)

    return app
