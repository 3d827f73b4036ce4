"""The request-to-engine translator: an HTTP body becomes a validated request, its prompts
token ids, and its choices engine requests (SamplingParams and the KV extras)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, TypeVar, Union

from fastapi import Request
from starlette.requests import ClientDisconnect

from pdpool.body_budget import BodiesBusy, BodyBudget, BodyHold
from pdpool.engine.bad_words import token_sequences
from pdpool.engine.engine_state import EngineView
from pdpool.engine.lora.registry import LoRARef, LoRARegistry
from pdpool.engine.outputs import prompt_fit_problem
from pdpool.engine.sampling_params import SamplingParams, offending_field
from pdpool.engine.server.errors import ApiError, client_closed
from pdpool.engine.server.logprobs import TokenText
from pdpool.engine.server.metrics import EngineMetrics
from pdpool.prompt_truncation import (
    TruncationError,
    cut_text,
    truncate_ids,
    truncation_tokens,
)
from pdpool.engine.server.template_kwargs import template_kwargs
from pdpool.engine.server.tools import check_tools, template_messages
from pdpool.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    message_text,
)
from pdpool.protocol import RequestError, parse_json_body, validate_request

T = TypeVar("T")
R = TypeVar("R", bound=GenerationRequest)

# At most this many choices (prompts x n) in one request: each is an engine request.
MAX_CHOICES = 64


@dataclasses.dataclass(frozen=True)
class ChoiceRequest:
    """One choice of an answer in engine terms: the arguments of one `add_request`."""

    index: int  # prompt_index * n + i
    first_of_prompt: bool  # usage counts each prompt once: on this choice
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: Optional[str]
    cache_hit_threshold: Optional[float]
    kv_transfer_params: Optional[dict[str, Any]]
    priority: int = 0  # vLLM's: lower runs first under --scheduling-policy priority
    lora: Optional[LoRARef] = None  # the adapter the request's `model` names
    # Starts once the first choice has its first output (it loads the prompt's KV).
    after_first_choice: bool = False


class RequestTranslator:
    """Body -> request -> engine inputs. The CPU-heavy steps (JSON, validation, chat template,
    tokenization) run on `prep_pool`, never on the event loop: /health and streams stay
    responsive meanwhile."""

    def __init__(
        self,
        engine: EngineView,
        metrics: EngineMetrics,
        prep_pool: ThreadPoolExecutor,
        loras: Optional[LoRARegistry] = None,
    ) -> None:
        self.engine, self.metrics, self.prep_pool = engine, metrics, prep_pool
        self.loras = loras  # with --enable-lora: the adapters a `model` may name
        self.max_body = engine.config.max_body_bytes
        self.bodies = BodyBudget(engine.config.max_body_bytes_in_flight)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.prep_pool, fn, *args)

    async def read_body(
        self, request: Request, hold: Optional[BodyHold] = None, limit: Optional[int] = None
    ) -> bytes:
        """The body, refused with 413 as soon as it passes `limit` (--max-body-bytes unless
        the route's own bound is smaller), announced or while it arrives: a huge body is never
        buffered. With `hold`, a large body draws on the server's budget of bodies in flight
        as it arrives (503 when that has no room)."""
        limit = self.max_body if limit is None else min(limit, self.max_body)
        why = "(--max-body-bytes)" if limit == self.max_body else "on this route"
        too_large = ApiError(f"the request body exceeds {limit} bytes {why}", 413)
        declared = request.headers.get("content-length", "")
        parts, size = [], 0
        try:
            if declared.isdigit():
                if int(declared) > limit:
                    raise too_large
                if hold is not None:
                    hold.grow_to(int(declared))
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                if hold is not None:
                    hold.grow_to(size)
                parts.append(chunk)
        except ClientDisconnect as exc:
            self.metrics.client_disconnected("body")
            raise client_closed() from exc
        except BodiesBusy as exc:
            raise ApiError(str(exc), 503, "ServiceUnavailable") from None
        return b"".join(parts)

    async def parse(self, request: Request, request_type: type[R]) -> R:
        """The body as `request_type`, validated (pdpool.protocol) and naming this model."""
        req: R = await self.decode_body(request, self._decode, request_type)
        self.check_model(req.model)
        return req

    async def decode_body(self, request: Request, decode: Callable[..., T], *args: Any) -> T:
        """`decode(body bytes, *args)` off the loop; its RequestError answered as an ApiError."""
        # The body and what is parsed from it count against the budget until parsed.
        with self.bodies.hold() as hold:
            raw = await self.read_body(request, hold)
            try:
                return await self.off_loop(decode, raw, *args)
            except RequestError as exc:
                raise ApiError(str(exc), exc.status, param=exc.param) from exc

    def check_model(self, name: object) -> Optional[LoRARef]:
        """404 unless `name` is absent, this engine's served model name or one of its LoRA
        adapters; the adapter it names, if any."""
        if name is None or name == self.engine.model_name:
            return None
        ref = self.loras.get(name) if self.loras is not None else None
        if ref is None:
            raise ApiError(f"The model `{name}` does not exist.", 404, "NotFoundError", "model")
        return ref

    def _decode(self, raw: bytes, request_type: type[R]) -> R:
        return self.validated(parse_json_body(raw), request_type)

    def validated(self, body: Any, request_type: type[R]) -> R:
        """A decoded body as `request_type` (pdpool.protocol's checks and this model's
        vocabulary); raises RequestError."""
        req: R = validate_request(body, request_type)
        vocab = self.engine.info.config["vocab_size"]
        for t in req.stop_token_ids or ():
            if t >= vocab:
                raise RequestError(
                    f"stop_token_ids must be in [0, {vocab}), got {t}", "stop_token_ids"
                )
        if req.bad_words:
            req._bad_words_ids = self._bad_word_sequences(req.bad_words)
        return req

    def token_text(self, req: GenerationRequest) -> TokenText:
        """How logprobs name tokens for this request (shared by its choices: one cache)."""
        return TokenText(self.engine.tokenizer, bool(req.return_tokens_as_token_ids))

    async def completion_prompt_ids(self, req: CompletionRequest) -> list[list[int]]:
        try:
            prompts = req.prompt_inputs()
        except ValueError as exc:
            raise ApiError(str(exc), param="prompt") from exc
        if any(p == "" for p in prompts):  # as vLLM, even where the tokenizer would add a BOS
            raise ApiError("the prompt is empty", param="prompt")
        keep, side = self._truncation(req)
        return await self.off_loop(
            lambda: [self.prompt_tokens(p, req.add_special_tokens, keep, side) for p in prompts]
        )

    async def chat_prompt_ids(self, req: ChatCompletionRequest) -> list[list[int]]:
        keep, side = self._truncation(req)
        return [await self.off_loop(self.chat_tokens, req, keep, side)]

    def _truncation(self, req: GenerationRequest) -> tuple[Optional[int], str]:
        """(prompt tokens the request keeps or None, the side kept: "left" is the end)."""
        try:
            keep = truncation_tokens(req.truncate_prompt_tokens, self.engine.max_model_len)
        except TruncationError as exc:
            raise ApiError(str(exc), param="truncate_prompt_tokens") from exc
        return keep, req.truncation_side or "left"

    # The tokenization of both endpoints, shared with /tokenize and the Renderer API
    # (renderer.py): a router that asks them gets the very token ids a generation request
    # would be computed from.
    def prompt_tokens(
        self,
        prompt: Union[str, list[int]],
        add_special_tokens: bool = True,
        keep: Optional[int] = None,
        side: str = "left",
    ) -> list[int]:
        """The prompt's token ids, truncated to `keep` from `side` when given. A text to
        truncate is first cut to what the longest servable prompt may spell instead of being
        refused, so a huge one costs no more tokenizer time than that prompt."""
        if isinstance(prompt, str):
            prompt = self._bounded_text(prompt, keep, side)
            ids = self.engine.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        else:
            ids = list(prompt)
        return truncate_ids(ids, keep, side)

    def _bounded_text(self, text: str, keep: Optional[int], side: str) -> str:
        if keep is None:
            self.refuse_if_surely_too_long(text)
            return text
        return cut_text(text, self.engine.max_model_len * self._longest_token_chars, side)

    @functools.cached_property
    def _longest_token_chars(self) -> int:
        vocab = self.engine.tokenizer.get_vocab()
        return max((len(token) for token in vocab), default=1) or 1

    def refuse_if_surely_too_long(self, text: str) -> None:
        """400 without tokenizing when `text` cannot be fewer tokens than the context holds:
        no token spells more characters than the vocabulary's longest, so a huge prompt
        costs no tokenizer time (and holds no thread) before it is refused."""
        at_least = -(-len(text) // self._longest_token_chars)
        if at_least > self.engine.max_model_len:
            raise ApiError(
                f"this model's maximum context length is {self.engine.max_model_len} tokens; "
                f"the prompt ({len(text)} characters) has at least {at_least} tokens",
                param="prompt",
            )

    def chat_tokens(
        self, req: ChatCompletionRequest, keep: Optional[int] = None, side: str = "left"
    ) -> list[int]:
        """The messages through the chat template, as the request's flags ask (vLLM's
        add_generation_prompt, continue_final_message, add_special_tokens); with `keep`,
        the rendered text is bounded and its ids truncated as `prompt_tokens` does."""
        tokenizer = self.engine.tokenizer
        try:
            msgs = template_messages(req.messages, message_text)
        except ValueError as exc:  # a malformed tool call in the history
            raise ApiError(str(exc), param="messages") from exc
        if keep is None:
            self.refuse_if_surely_too_long("".join(m["content"] for m in msgs))
        # As vLLM: the tools go to the template (Qwen3's renders them Hermes-style).
        tools = (req.model_extra or {}).get("tools")
        try:
            check_tools([] if tools is None else tools)
        except RequestError as exc:  # every caller answers 400 with it, render's included
            raise ApiError(str(exc), param="tools") from exc
        try:
            variables = getattr(tokenizer, "template_variables", None)
            extra = template_kwargs(req.chat_template_kwargs, variables)
        except RequestError as exc:
            raise ApiError(str(exc), param="chat_template_kwargs") from exc
        try:
            text = tokenizer.apply_chat_template(
                msgs,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tokenize=False,
                **({"tools": tools} if tools else {}),
                **extra,
            )
        except ValueError as exc:  # no template, or the template refused the messages
            raise ApiError(str(exc), param="messages") from exc
        text = self._bounded_text(text, keep, side)
        ids = tokenizer(text, add_special_tokens=req.add_special_tokens)["input_ids"]
        return truncate_ids(ids, keep, side)

    def refuse_if_unservable(self, prompt_ids: list[int], max_tokens: int) -> None:
        """400 here, in the server, for a prompt the engine could never run: nothing of it
        crosses to the engine core."""
        problem = prompt_fit_problem(
            len(prompt_ids), max_tokens, self.engine.max_model_len, self.engine.kv_capacity_tokens
        )
        if problem is not None:
            raise ApiError(problem, param="prompt")
        if not self.in_vocabulary(prompt_ids):
            vocab = self.engine.info.config["vocab_size"]
            raise ApiError(f"prompt token ids must be in [0, {vocab})", param="prompt")

    def in_vocabulary(self, ids: list[int]) -> bool:
        vocab = self.engine.info.config["vocab_size"]
        return all(0 <= t < vocab for t in ids)

    def servable_params(
        self, req: GenerationRequest, prompts: list[list[int]], default_max_tokens: int = 16
    ) -> SamplingParams:
        """The request's sampling parameters, once its prompts are known to be servable
        here (400 otherwise): what the engine would run them with."""
        try:
            params = req.sampling_params(default_max_tokens=default_max_tokens)
        except ValueError as exc:
            raise ApiError(str(exc), param=offending_field(exc)) from exc
        if req._bad_words_ids:  # tokenized by `validated`, which every body goes through
            params = dataclasses.replace(params, bad_words_token_ids=req._bad_words_ids)
        if len(prompts) * params.n > MAX_CHOICES:
            raise ApiError(
                f"n x the number of prompts must be at most {MAX_CHOICES}, "
                f"got {len(prompts) * params.n}",
                param="n",
            )
        for prompt_ids in prompts:
            self.refuse_if_unservable(prompt_ids, params.max_tokens)
        return params

    def _bad_word_sequences(self, words: list[str]) -> list[list[int]]:
        """The token sequences `words` ban, as vLLM tokenizes them; RequestError naming
        bad_words. Up to a few hundred milliseconds for the longest words: `validated` runs
        it with the body's parsing, off the event loop."""
        tokenizer = self.engine.tokenizer

        def encode(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        try:
            return token_sequences(words, encode, self.engine.info.config["vocab_size"])
        except ValueError as exc:
            raise RequestError(str(exc), "bad_words") from exc

    def choice_requests(
        self, req: GenerationRequest, prompts: list[list[int]], client_request_id: Optional[str]
    ) -> list[ChoiceRequest]:
        """n choices per prompt, index = prompt_index * n + i, each its own engine request.
        With a seed, choice i of every prompt samples with seed + i (as vLLM v1), so a
        choice equals a single request sent with that seed."""
        params = self.servable_params(req, prompts)
        lora = self.check_model(req.model)
        n = params.n
        kv_params = req.kv_params_dict()
        # n choices of one prompt may load its prefill: the first loads it, the others start
        # once it has (then the prompt is in this engine's prefix cache).
        if (
            kv_params is not None
            and len(prompts) * n > 1
            and (len(prompts) > 1 or not kv_params.get("do_remote_prefill"))
        ):
            raise ApiError(
                "kv_transfer_params: only with one prompt, and with n>1 only to load a "
                "remote prefill (do_remote_prefill)",
                param="kv_transfer_params",
            )
        return [
            ChoiceRequest(
                index=p * n + i,
                first_of_prompt=i == 0,
                # the client's id, if it sent one, stays readable in the engine's logs
                request_id=f"{client_request_id or uuid.uuid4().hex}-{uuid.uuid4().hex[:8]}",
                prompt_ids=prompt_ids,
                params=dataclasses.replace(
                    params,
                    n=1,
                    seed=None if params.seed is None else params.seed + i,
                    # the prompt's first choice computes them for all its choices
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None,
                ),
                cache_salt=req.cache_salt,
                cache_hit_threshold=req.cache_hit_threshold,
                kv_transfer_params=kv_params if i == 0 else None,
                priority=req.priority,
                lora=lora,
                after_first_choice=kv_params is not None and i > 0,
            )
            for p, prompt_ids in enumerate(prompts)
            for i in range(n)
        ]
