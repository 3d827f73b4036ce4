"""POST /inference/v1/generate: vLLM's token-in/token-out route on our engine. It takes what
the render routes give (a GenerateRequest: token_ids and vLLM's sampling_params) and answers
with token ids per choice (GenerateTokensResponse, or its SSE chunks when `stream`).

The body becomes the equivalent /v1/completions body (render_shapes.completion_body) and runs
through the same translator, runner and checks as /v1/completions."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncGenerator, Callable, Optional, Union

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pdpool.engine.outputs import TokenLogprob
from pdpool.engine.server.choices import Choice, ChoiceRunner, until_disconnect
from pdpool.engine.server.errors import ApiError
from pdpool.engine.server.logprobs import (
    TokenText,
    check_prompt_logprobs_size,
    generate_formatter,
    merge_chat,
    vllm_prompt_logprobs,
)
from pdpool.engine.server.metrics import EngineMetrics
from pdpool.engine.server.protocol import CompletionRequest
from pdpool.engine.server.render_shapes import (
    GenerateFinal,
    completion_body,
    generate_choice,
    generate_chunk,
    generate_response,
    generate_usage,
)
from pdpool.engine.server.response_writer import DONE_EVENT, error_event, sse
from pdpool.engine.server.translator import RequestTranslator
from pdpool.protocol import parse_json_body


def _logprobs_formatter(
    num_top: Optional[int],
) -> Callable[[], Callable[[list[TokenLogprob]], dict[str, Any]]]:
    # Without logprobs the engine sends none: the formatter is never called.
    return lambda: generate_formatter(num_top or 0)


def _prompt_logprobs(
    prompt: list[int], entries: list[TokenLogprob], text_of: TokenText, detokenize: bool
) -> list[Optional[dict[str, Any]]]:
    rows = vllm_prompt_logprobs(prompt, entries, text_of)
    if not detokenize:  # vLLM's `detokenize: false`: the tokens have no text
        for row in rows:
            for entry in (row or {}).values():
                entry["decoded_token"] = None
    return rows


class TokenGenerateRoute:
    """Bound in api.build_app (response_model=None)."""

    def __init__(
        self,
        translator: RequestTranslator,
        runner: ChoiceRunner,
        metrics: EngineMetrics,
        model_name: str,
    ):
        self.translator, self.runner, self.metrics = translator, runner, metrics
        self.model_name = model_name
        engine = translator.engine
        self.context_tokens = min(engine.max_model_len, engine.kv_capacity_tokens)

    def _parse(self, raw: bytes) -> tuple[CompletionRequest, dict[str, Any]]:
        body = parse_json_body(raw)
        ids = body.get("token_ids") if isinstance(body, dict) else None
        # vLLM: without max_tokens, as many as the context leaves after the prompt
        room = self.context_tokens - (len(ids) if isinstance(ids, list) else 0)
        req = self.translator.validated(completion_body(body, max(room, 1)), CompletionRequest)
        return req, body

    async def generate(self, http_req: Request) -> Union[dict[str, Any], Response]:
        req, body = await self.translator.decode_body(http_req, self._parse)
        self.translator.check_model(req.model)
        prompt: list[int] = body["token_ids"]  # checked by completion_body
        header_id = http_req.headers.get("x-request-id")
        body_id = body.get("request_id")
        request_id = "generate-tokens-" + (
            header_id or (body_id if isinstance(body_id, str) else None) or uuid.uuid4().hex
        )
        if req.prompt_logprobs is not None and req.prompt_logprobs >= 0:
            try:  # one copy for the answer: its choices share the prompt
                check_prompt_logprobs_size([len(prompt)], 1, req.prompt_logprobs, 1)
            except ValueError as exc:
                raise ApiError(str(exc), param="prompt_logprobs") from exc
        specs = self.translator.choice_requests(req, [prompt], header_id)
        choices = await until_disconnect(
            http_req, self.runner.start(specs, _logprobs_formatter(req.logprobs)), self.metrics
        )
        return_ids = body.get("return_token_ids") is True
        if not req.stream:
            await self.runner.run_to_end(http_req, choices)
            return await self._whole(req, body, request_id, prompt, return_ids, choices)
        options = req.stream_options
        events = self._events(
            request_id,
            choices,
            prompt if return_ids else None,
            bool(options and options.include_usage),
            bool(options and options.continuous_usage_stats),
        )
        return StreamingResponse(events, media_type="text/event-stream")

    async def _whole(
        self,
        req: CompletionRequest,
        body: dict[str, Any],
        request_id: str,
        prompt: list[int],
        return_ids: bool,
        choices: list[Choice],
    ) -> Union[dict[str, Any], Response]:
        finals = [
            GenerateFinal(c.index, c.last, c.token_ids, merge_chat(c.logprobs)) for c in choices
        ]
        created = int(time.time())
        entries = choices[0].prompt_logprobs
        if entries is None:
            return generate_response(
                request_id, self.model_name, created, prompt, return_ids, finals
            )
        text_of = self.translator.token_text(req)
        detokenize = body["sampling_params"].get("detokenize") is not False

        def encoded() -> bytes:
            rows = _prompt_logprobs(prompt, entries, text_of, detokenize)
            answer = generate_response(
                request_id, self.model_name, created, prompt, return_ids, finals, rows
            )
            return json.dumps(answer).encode()

        # A long prompt's logprobs take a while to build: not on the loop the streams share.
        return Response(await asyncio.to_thread(encoded), media_type="application/json")

    async def _events(
        self,
        request_id: str,
        choices: list[Choice],
        prompt_ids: Union[list[int], None],
        include_usage: bool,
        continuous_usage: bool,
    ) -> AsyncGenerator[str, None]:
        """vLLM's stream: one chunk per output with new tokens (or its end), the prompt ids
        on the first when asked, a closing usage chunk when asked, then [DONE]."""
        pumped, tasks = self.runner.pump(choices)
        prompt_len, remaining = choices[0].first.num_prompt_tokens, len(choices)
        try:
            async for c, out in pumped:
                if isinstance(out, Exception) or out.finish_reason == "error":
                    yield error_event(out)
                    break
                logprobs = c.absorb(out)
                remaining -= out.finished
                if out.new_token_ids or out.finished:
                    usage = (
                        generate_usage(prompt_len, len(c.token_ids), out.num_cached_tokens)
                        if continuous_usage
                        else None
                    )
                    choice = generate_choice(
                        c.index,
                        out.finish_reason,
                        out.new_token_ids,
                        stream=True,
                        stop_reason=out.stop_reason,
                        logprobs=logprobs,
                    )
                    yield sse(generate_chunk(request_id, choice, usage, prompt_ids))
                    prompt_ids = None
                if not remaining:
                    break
            if not remaining and include_usage:
                total = sum(len(c.token_ids) for c in choices)
                cached = choices[0].last.num_cached_tokens
                usage = generate_usage(prompt_len, total, cached, compact=True)
                yield sse(generate_chunk(request_id, {}, usage))
            yield DONE_EVENT
        finally:
            await pumped.aclose()
            await self.runner.close(choices, tasks)
