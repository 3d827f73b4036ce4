"""The two generation endpoints, /v1/completions and /v1/chat/completions: each a Responder
(which body, which prompts) and a ChoiceFormat (which JSON); the steps they share are the
Responder's, the writing is the ResponseWriter's."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Generic, Optional, TypeVar, Union

from fastapi import Request
from fastapi.responses import Response

from pdpool.engine.outputs import RequestOutput
from pdpool.engine.server.choices import Choice, ChoiceRunner, until_disconnect
from pdpool.engine.server.echo import (
    EchoTooLarge,
    PromptEcho,
    StreamedEcho,
    echoed_message,
    prompt_echo,
)
from pdpool.engine.server.logprobs import (
    TokenText,
    chat_formatter,
    check_prompt_logprobs_size,
    echoed_prompt_logprobs,
    completion_formatter,
    merge_chat,
    merge_completion,
)
from pdpool.engine.server.metrics import EngineMetrics
from pdpool.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    client_request_id,
)
from pdpool.engine.server.response_writer import ChoiceFormat, ResponseWriter
from pdpool.engine.server.errors import ApiError
from pdpool.engine.server.structured_request import constrain_off_loop
from pdpool.engine.server.tools import (
    ToolRequest,
    ToolStream,
    forced_spec,
    parse_calls,
    tool_request_of,
)
from pdpool.engine.server.tools import finish_reason as tool_finish_reason
from pdpool.engine.server.translator import ChoiceRequest, RequestTranslator
from pdpool.engine.structured.spec import GuidedSpec
from pdpool.protocol import RequestError

R = TypeVar("R", bound=GenerationRequest)


class Responder(abc.ABC, Generic[R]):
    """Body -> prompts -> choices -> answer. From the body read until the first outputs the
    work races the client: one that goes away cancels it (see until_disconnect)."""

    request_type: type[R]
    choice_format: type[ChoiceFormat]

    def __init__(
        self,
        translator: RequestTranslator,
        runner: ChoiceRunner,
        writer: ResponseWriter,
        metrics: EngineMetrics,
    ) -> None:
        self.translator, self.runner, self.writer = translator, runner, writer
        self.metrics = metrics

    # Bound in api.build_app with response_model=None: FastAPI takes no response model from
    # the return annotation.
    async def create(self, http_req: Request) -> Union[dict[str, Any], Response]:
        req = await self.translator.parse(http_req, self.request_type)
        fmt = self.new_format(req)
        prompts = await until_disconnect(http_req, self.prompt_ids(req), self.metrics)
        try:
            await self.prepare_format(req, fmt)
        except EchoTooLarge as exc:
            raise ApiError(str(exc), param="echo") from exc
        self._check_prompt_logprobs(req, prompts)
        choices = await until_disconnect(
            http_req, self._start(http_req, req, prompts, fmt), self.metrics
        )
        await self.choices_started(req, fmt, prompts, choices)
        return await self.writer.write(http_req, req, fmt, prompts, choices)

    def new_format(self, req: R) -> ChoiceFormat:
        return self.choice_format(self.translator.token_text(req))

    @abc.abstractmethod
    async def prompt_ids(self, req: R) -> list[list[int]]:
        """The prompts of the request, as token ids (one list per prompt)."""

    async def prepare_format(self, req: R, fmt: ChoiceFormat) -> None:
        """What the format needs of the request once its prompts are tokenized, before its
        choices start (EchoTooLarge)."""

    def _check_prompt_logprobs(self, req: R, prompts: list[list[int]]) -> None:
        """400 before any choice starts when the answer's prompt logprobs pass their bound
        (they come once per choice, and twice with completions' echo)."""
        try:
            k = req.asked_prompt_logprobs()
        except ValueError:
            return  # a bad value: the sampling parameters refuse it next
        if k is None or k < 0:
            return
        echoed = isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None
        try:
            check_prompt_logprobs_size([len(p) for p in prompts], req.n, k, 2 if echoed else 1)
        except ValueError as exc:
            raise ApiError(str(exc), param="prompt_logprobs") from exc

    async def choices_started(
        self, req: R, fmt: ChoiceFormat, prompts: list[list[int]], choices: list[Choice]
    ) -> None:
        """What the format needs of the choices' first outputs before the answer is
        written."""

    async def _start(
        self, http_req: Request, req: R, prompts: list[list[int]], fmt: ChoiceFormat
    ) -> list[Choice]:
        specs = self.translator.choice_requests(req, prompts, client_request_id(http_req, req))
        specs = await self._constrained(req, specs)
        return await self.runner.start(specs, fmt.logprobs_formatter)

    async def _constrained(self, req: R, specs: list[ChoiceRequest]) -> list[ChoiceRequest]:
        """The choices under the body's output constraint and logit_bias (400 for bad ones),
        checked off the event loop."""
        engine = self.translator.engine
        try:
            params = await constrain_off_loop(
                specs[0].params,
                req.model_extra or {},
                engine.info.config["vocab_size"],
                self.tool_spec(req),
                engine.config.structured_limits,
            )
        except RequestError as exc:
            raise ApiError(str(exc), exc.status, param=exc.param) from exc
        if params is specs[0].params:
            return specs
        return [
            dataclasses.replace(
                s,
                params=dataclasses.replace(
                    s.params, guided=params.guided, logit_bias=params.logit_bias
                ),
            )
            for s in specs
        ]

    def tool_spec(self, req: R) -> Optional[GuidedSpec]:
        """The constraint that the request's tool_choice implies (chat only)."""
        return None


class CompletionFormat(ChoiceFormat):
    id_prefix = "cmpl"
    response_object = chunk_object = "text_completion"
    new_logprobs_formatter = staticmethod(completion_formatter)
    merge_logprobs = staticmethod(merge_completion)
    echo: Optional[PromptEcho] = None  # the request's echo, when it asks for one

    def full_choice(
        self,
        index: int,
        text: str,
        finish_reason: Optional[str],
        logprobs: Optional[dict[str, Any]],
        stop_reason: Union[int, str, None] = None,
    ) -> dict[str, Any]:
        if self.echo is not None:
            text, logprobs = self.echo.whole(index, text), self.echo.whole_logprobs(index, logprobs)
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def chunk_choice(
        self, index: int, out: RequestOutput, logprobs: Optional[dict[str, Any]]
    ) -> dict[str, Any]:
        text = out.new_text
        if self.echo is not None:
            text, logprobs = self.echo.delta(index, text, logprobs)
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        }


class CompletionResponder(Responder[CompletionRequest]):
    request_type = CompletionRequest
    choice_format = CompletionFormat

    async def prompt_ids(self, req: CompletionRequest) -> list[list[int]]:
        return await self.translator.completion_prompt_ids(req)

    async def prepare_format(self, req: CompletionRequest, fmt: ChoiceFormat) -> None:
        if req.echo and isinstance(fmt, CompletionFormat):
            fmt.echo = await self.translator.off_loop(  # a long prompt decodes for a while
                prompt_echo,
                req.prompt_inputs(),
                req.n,
                req.max_tokens,
                bool(req.return_token_ids),
                self._decode_in_vocabulary,
            )

    async def choices_started(
        self,
        req: CompletionRequest,
        fmt: ChoiceFormat,
        prompts: list[list[int]],
        choices: list[Choice],
    ) -> None:
        echo = fmt.echo if isinstance(fmt, CompletionFormat) else None
        if echo is None or req.logprobs is None:
            return
        per_prompt, num_top, text_of = echo.per_prompt, req.logprobs, fmt.text_of

        def prompt_parts() -> list[dict[str, Any]]:
            return [
                echoed_prompt_logprobs(
                    prompts[c.index // per_prompt], c.prompt_logprobs or [], text_of, num_top
                )
                for c in choices
                if c.first_of_prompt
            ]

        # Up to ~10 MB of JSON to come: built off the event loop, where other streams run.
        echo.logprobs = await self.translator.off_loop(prompt_parts)

    def _decode_in_vocabulary(self, ids: list[int]) -> str:
        """The text of token ids; "" for ids outside the vocabulary, which starting the
        choices refuses (400) next."""
        if not self.translator.in_vocabulary(ids):
            return ""
        return self.translator.engine.tokenizer.decode(ids)


class ChatFormat(ChoiceFormat):
    id_prefix = "chatcmpl"
    prompt_ids_in_choice = False
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    new_logprobs_formatter = staticmethod(chat_formatter)
    merge_logprobs = staticmethod(merge_chat)
    # The echoed message's text when the request asks for echo ("" when no message echoes).
    echo: Optional[str] = None

    def __init__(self, text_of: TokenText):
        super().__init__(text_of)
        self._streamed_echo = StreamedEcho()

    def full_choice(
        self,
        index: int,
        text: str,
        finish_reason: Optional[str],
        logprobs: Optional[dict[str, Any]],
        stop_reason: Union[int, str, None] = None,
    ) -> dict[str, Any]:
        return self._echoed(
            {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        )

    def _echoed(self, choice: dict[str, Any]) -> dict[str, Any]:
        """As vLLM: with echo, the content is the echoed text and the answer's (or "")."""
        if self.echo is not None:
            message = choice["message"]
            message["content"] = self.echo + (message["content"] or "")
        return choice

    def chunk_choice(
        self, index: int, out: RequestOutput, logprobs: Optional[dict[str, Any]]
    ) -> dict[str, Any]:
        choice = self._chunk(index, out, logprobs)
        if self.echo:
            delta = choice["delta"]
            text = self._streamed_echo.prefix(index, self.echo, delta.get("content") or "")
            if text:
                delta["content"] = text
        return choice

    def _chunk(
        self, index: int, out: RequestOutput, logprobs: Optional[dict[str, Any]]
    ) -> dict[str, Any]:
        # a last chunk without new text has an empty delta
        content = {"content": out.new_text} if out.new_text or not out.finished else {}
        choice = {
            "index": index,
            "delta": content,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
        }
        if out.finished:  # vLLM's chat stream names stop_reason in the last chunk only
            choice["stop_reason"] = out.stop_reason
        return choice

    def opening_choice(self, index: int) -> Optional[dict[str, Any]]:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }


class ToolChatFormat(ChatFormat):
    """Chat choices of a request with tools: the text parsed into tool_calls (tools.py)."""

    def __init__(self, text_of: TokenText, tools: ToolRequest):
        super().__init__(text_of)
        self.tools = tools
        self.streams: dict[int, ToolStream] = {}

    def full_choice(
        self,
        index: int,
        text: str,
        finish_reason: Optional[str],
        logprobs: Optional[dict[str, Any]],
        stop_reason: Union[int, str, None] = None,
    ) -> dict[str, Any]:
        choice = super().full_choice(index, text, finish_reason, logprobs, stop_reason)
        if self.tools.choice == "none":
            return choice
        content, calls = parse_calls(text, self.tools)
        choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
        choice["finish_reason"] = tool_finish_reason(self.tools, calls, finish_reason)
        return self._echoed(choice)

    def _chunk(
        self, index: int, out: RequestOutput, logprobs: Optional[dict[str, Any]]
    ) -> dict[str, Any]:
        choice = super()._chunk(index, out, logprobs)
        if self.tools.choice == "none":
            return choice
        stream = self.streams.setdefault(index, ToolStream(self.tools))
        choice["delta"] = stream.delta(out.new_text, out.finished)
        choice["finish_reason"] = tool_finish_reason(
            self.tools, [{"name": n} for n in stream.names], out.finish_reason
        )
        return choice


class ChatResponder(Responder[ChatCompletionRequest]):
    request_type = ChatCompletionRequest
    choice_format = ChatFormat

    def new_format(self, req: ChatCompletionRequest) -> ChoiceFormat:
        try:
            tools = tool_request_of(req.model_extra or {})
        except RequestError as exc:
            raise ApiError(str(exc), exc.status, param=exc.param) from exc
        if tools is None:
            return super().new_format(req)
        return ToolChatFormat(self.translator.token_text(req), tools)

    def tool_spec(self, req: ChatCompletionRequest) -> Optional[GuidedSpec]:
        return forced_spec(tool_request_of(req.model_extra or {}))

    async def prompt_ids(self, req: ChatCompletionRequest) -> list[list[int]]:
        return await self.translator.chat_prompt_ids(req)

    async def prepare_format(self, req: ChatCompletionRequest, fmt: ChoiceFormat) -> None:
        if req.echo and isinstance(fmt, ChatFormat):
            fmt.echo = await self.translator.off_loop(echoed_message, req)
