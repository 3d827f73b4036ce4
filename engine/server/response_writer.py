"""The writer shared by /v1/completions and /v1/chat/completions: an answer in OpenAI's shape,
whole or as an SSE stream, with usage and logprobs. What differs between the two endpoints is
a ChoiceFormat; everything here but the writer's two loops is pure."""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import json
import time
from typing import Any, AsyncGenerator, Callable, Optional, Union

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pdpool.engine.outputs import RequestOutput
from pdpool.engine.server.choices import Choice, ChoiceRunner, LogprobsFormatter
from pdpool.engine.server.errors import engine_error, output_error
from pdpool.engine.server.logprobs import TokenText, vllm_prompt_logprobs
from pdpool.engine.server.metrics import EngineMetrics
from pdpool.engine.server.protocol import (
    GenerationRequest,
    client_request_id,
    error_body,
    usage_dict,
)

DONE_EVENT = "data: [DONE]\n\n"


class ChoiceFormat(abc.ABC):
    """The JSON of one endpoint's choices, one instance per HTTP request (its token texts
    are cached across the request's choices)."""

    id_prefix: str
    response_object: str
    chunk_object: str
    # vLLM's return_token_ids: a prompt's ids in each of its choices (completions) or once,
    # at the top of the answer (chat: one prompt).
    prompt_ids_in_choice = True
    # From logprobs.py: a formatter for one choice over the request's token texts (it may
    # carry state from chunk to chunk), and the merge of a choice's chunks for a whole answer.
    new_logprobs_formatter: Callable[[TokenText], LogprobsFormatter]
    merge_logprobs: Callable[[list[dict[str, Any]]], Optional[dict[str, Any]]]

    def __init__(self, text_of: TokenText):
        self.text_of = text_of

    def logprobs_formatter(self) -> LogprobsFormatter:
        return self.new_logprobs_formatter(self.text_of)

    @abc.abstractmethod
    def full_choice(
        self,
        index: int,
        text: str,
        finish_reason: Optional[str],
        logprobs: Optional[dict[str, Any]],
        stop_reason: Union[int, str, None] = None,
    ) -> dict[str, Any]:
        """One choice of a whole (non-streamed) answer."""

    @abc.abstractmethod
    def chunk_choice(
        self, index: int, out: RequestOutput, logprobs: Optional[dict[str, Any]]
    ) -> dict[str, Any]:
        """One choice of a streamed chunk."""

    def opening_choice(self, index: int) -> Optional[dict[str, Any]]:
        """The chunk that opens a streamed choice before its tokens, if the endpoint has one."""
        return None


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def usage_of(choices: list[Choice]) -> dict[str, Any]:
    # As vLLM: each prompt's tokens count once, every choice's completion tokens count.
    firsts = [c.last for c in choices if c.first_of_prompt]
    return usage_dict(
        sum(o.num_prompt_tokens for o in firsts),
        sum(c.last.num_output_tokens for c in choices),
        sum(o.num_cached_tokens for o in firsts),
        sum(o.num_pulled_tokens for o in firsts),
    )


@dataclasses.dataclass(frozen=True)
class ResponseHead:
    """The fields every response object and chunk of one answer starts with."""

    id: str
    created: int
    model: str

    def of(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def full_response(
    head: ResponseHead,
    fmt: ChoiceFormat,
    choices: list[Choice],
    prompts: list[list[int]],
    return_token_ids: bool = False,
) -> dict[str, Any]:
    """The whole answer; with `return_token_ids`, the token ids as vLLM adds them; with
    prompt logprobs, vLLM's `prompt_logprobs` beside them."""
    answer = {
        **head.of(fmt.response_object),
        "choices": [
            fmt.full_choice(
                c.index,
                "".join(c.text),
                c.last.finish_reason,
                fmt.merge_logprobs(c.logprobs),
                c.last.stop_reason,
            )
            for c in choices
        ],
        "usage": usage_of(choices),
        "kv_transfer_params": choices[0].last.kv_transfer_params if len(choices) == 1 else None,
    }
    per_prompt = choices_per_prompt(choices, prompts)
    if choices[0].prompt_logprobs is not None:
        text_of = TokenText(fmt.text_of.tokenizer)  # vLLM's texts, whatever the logprobs'
        for c, choice in zip(choices, answer["choices"], strict=True):
            prompt_logprobs = vllm_prompt_logprobs(
                prompts[c.index // per_prompt], c.prompt_logprobs or [], text_of
            )
            if fmt.prompt_ids_in_choice:
                choice["prompt_logprobs"] = prompt_logprobs
            else:
                answer["prompt_logprobs"] = prompt_logprobs
    if return_token_ids:
        for c, choice in zip(choices, answer["choices"], strict=True):
            choice["token_ids"] = list(c.token_ids)
            if fmt.prompt_ids_in_choice:
                choice["prompt_token_ids"] = prompts[c.index // per_prompt]
        if not fmt.prompt_ids_in_choice:
            answer["prompt_token_ids"] = prompts[0]
    return answer


def choices_per_prompt(choices: list[Choice], prompts: list[list[int]]) -> int:
    """n: choice i answers prompt i // n."""
    return max(len(choices) // max(len(prompts), 1), 1)


def error_event(failure: RequestOutput | Exception) -> str:
    """The stream's last event before [DONE] when a choice fails after its first token."""
    err = output_error(failure) if isinstance(failure, RequestOutput) else engine_error(failure)
    return sse(error_body(str(err), err.err_type, err.status))


class StreamTokenIds:
    """vLLM's return_token_ids in a stream: a choice's prompt ids once (chat: at the top of its
    opening chunk), then its new token ids in each chunk. The gateway uses them to continue a
    broken stream exactly (request migration)."""

    def __init__(self, enabled: bool, prompts: list[list[int]], choices_per_prompt: int):
        self.enabled, self.prompts, self.per_prompt = enabled, prompts, choices_per_prompt
        self.sent: set[int] = set()

    def add(
        self, chunk: dict[str, Any], index: int, out: Optional[RequestOutput]
    ) -> dict[str, Any]:
        if not self.enabled:
            return chunk
        holder = chunk if out is None else chunk["choices"][0]
        if out is not None:
            holder["token_ids"] = out.new_token_ids
        if index not in self.sent:
            self.sent.add(index)
            holder["prompt_token_ids"] = self.prompts[index // self.per_prompt]
        return chunk


class ResponseWriter:
    """Writes started choices as one answer: a whole response, or an SSE stream whose final
    chunk carries kv_transfer_params (and a usage chunk when asked for). An error that ends
    a choice is the answer's HTTP error, or an error event in the stream."""

    def __init__(self, runner: ChoiceRunner, metrics: EngineMetrics, model_name: str) -> None:
        self.runner, self.metrics, self.model_name = runner, metrics, model_name

    async def write(
        self,
        http_req: Request,
        req: GenerationRequest,
        fmt: ChoiceFormat,
        prompts: list[list[int]],
        choices: list[Choice],
    ) -> Union[dict[str, Any], Response]:
        # As vLLM: a LoRA request's answer names its adapter.
        model = req.model if isinstance(req.model, str) and req.model else self.model_name
        # As vLLM: the client's id (its X-Request-Id, else the body's) names the answer.
        answer_id = client_request_id(http_req, req) or choices[0].request_id
        head = ResponseHead(f"{fmt.id_prefix}-{answer_id}", int(time.time()), model)
        if not req.stream:
            await self.runner.run_to_end(http_req, choices)
            args = (head, fmt, choices, prompts, bool(req.return_token_ids))
            if choices[0].prompt_logprobs is None:
                return full_response(*args)
            # Up to ~20 MB of JSON: built off the event loop, where the other streams run.
            body = await asyncio.to_thread(lambda: json.dumps(full_response(*args)).encode())
            return Response(body, media_type="application/json")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        token_ids = StreamTokenIds(
            bool(req.return_token_ids), prompts, choices_per_prompt(choices, prompts)
        )
        return StreamingResponse(
            self._events(head, fmt, choices, token_ids, include_usage),
            media_type="text/event-stream",
        )

    async def _events(
        self,
        head: ResponseHead,
        fmt: ChoiceFormat,
        choices: list[Choice],
        token_ids: StreamTokenIds,
        include_usage: bool,
    ) -> AsyncGenerator[str, None]:
        pumped, tasks = self.runner.pump(choices)
        ended = False
        try:
            for c in choices:
                opening = fmt.opening_choice(c.index)
                if opening is not None:
                    yield sse(
                        token_ids.add(
                            {**head.of(fmt.chunk_object), "choices": [opening]}, c.index, None
                        )
                    )
            remaining = len(choices)
            async for c, out in pumped:
                if isinstance(out, Exception) or out.finish_reason == "error":
                    yield error_event(out)
                    break
                lp = c.absorb(out)
                chunk = token_ids.add(
                    {**head.of(fmt.chunk_object), "choices": [fmt.chunk_choice(c.index, out, lp)]},
                    c.index,
                    out,
                )
                if out.finished:
                    remaining -= 1
                    if len(choices) == 1:
                        chunk["kv_transfer_params"] = out.kv_transfer_params
                yield sse(chunk)
                if not remaining:
                    break
            if not remaining and include_usage:
                yield sse({**head.of(fmt.chunk_object), "choices": [], "usage": usage_of(choices)})
            yield DONE_EVENT
            ended = True
        finally:
            if not ended:  # the client went away mid-stream
                self.metrics.client_disconnected("running")
            await pumped.aclose()
            await self.runner.close(choices, tasks)
