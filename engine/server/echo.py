"""`echo`, as vLLM answers it. Completions: each choice's text starts with its prompt's.
Chat: each choice's content starts with the last message's text when that message has the
answer's role (the assistant's, or with `add_generation_prompt: false` the last message's
own): a continued message comes back whole.

A completion's text prompt is echoed as the client wrote it, a token-id prompt as its ids
decode. With `return_token_ids` the prompt is in `prompt_token_ids` and its text is not
repeated. With `max_tokens` 0 the engine makes one token (it cannot make none) and the
answer shows the prompt alone.

An answer repeats its echo once per choice, so a large prompt or message times many choices
(a truncated prompt is echoed whole) would make an answer far larger than its request: the
echoed text of a whole answer is bounded (MAX_ECHO_BYTES, a 400 naming `echo` beyond)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

from pdpool.engine.server.logprobs import after_prompt
from pdpool.engine.server.protocol import ChatCompletionRequest, message_text

PromptInput = Union[str, list[int]]

MAX_ECHO_BYTES = 16 * 1024 * 1024  # of echoed text in one answer, all its choices together


class EchoTooLarge(ValueError):
    pass


def check_echo_size(texts: list[str], per_prompt: int) -> None:
    """EchoTooLarge when `texts`, each repeated `per_prompt` times, pass MAX_ECHO_BYTES."""
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts) * per_prompt
    if size > MAX_ECHO_BYTES:
        raise EchoTooLarge(
            f"echo would repeat {size} bytes of the request in the answer (at most "
            f"{MAX_ECHO_BYTES}): ask for fewer choices or echo a shorter prompt"
        )


@dataclasses.dataclass
class StreamedEcho:
    """A streamed choice's echo goes with its first output, not before it: until then a
    decode-first sidecar cannot tell an echo from an accepted request's first token."""

    _echoed: set[int] = dataclasses.field(default_factory=set)  # choices that had theirs

    def first(self, index: int) -> bool:
        """Whether this is the choice's first output (and from now on it is not)."""
        if index in self._echoed:
            return False
        self._echoed.add(index)
        return True

    def prefix(self, index: int, echo: str, text: str) -> str:
        return echo + text if self.first(index) else text


Logprobs = Optional[dict[str, Any]]


@dataclasses.dataclass
class PromptEcho:
    texts: list[str]  # one per prompt
    per_prompt: int  # choices per prompt (n): choice i answers prompt i // n
    prompt_only: bool  # max_tokens 0
    # With `logprobs`: each prompt's part of the choices' logprobs (set once they start).
    logprobs: Optional[list[dict[str, Any]]] = None
    _streamed: StreamedEcho = dataclasses.field(default_factory=StreamedEcho)

    def whole(self, index: int, text: str) -> str:
        """A whole choice's text."""
        prompt = self.texts[index // self.per_prompt]
        return prompt if self.prompt_only else prompt + text

    def whole_logprobs(self, index: int, logprobs: Logprobs) -> Logprobs:
        """A whole choice's logprobs: its prompt's, then its tokens' (unless prompt only)."""
        if self.logprobs is None:
            return logprobs
        prompt = self.logprobs[index // self.per_prompt]
        return prompt if self.prompt_only else after_prompt(prompt, logprobs)

    def delta(self, index: int, text: str, logprobs: Logprobs = None) -> tuple[str, Logprobs]:
        """A streamed choice's next text and logprobs: its first ones carry the prompt's."""
        if self.prompt_only:
            text, logprobs = "", None
        first = self._streamed.first(index)
        if not first:
            return text, logprobs
        prompt = self.texts[index // self.per_prompt]
        if self.logprobs is not None:
            logprobs = after_prompt(self.logprobs[index // self.per_prompt], logprobs)
        return prompt + text, logprobs


def prompt_echo(
    prompts: list[PromptInput],
    n: int,
    max_tokens: Optional[int],
    with_token_ids: bool,
    decode: Callable[[list[int]], str],
) -> PromptEcho:
    """The echo of a request's `prompts` (as the client sent them); EchoTooLarge."""
    texts = ["" if with_token_ids else (p if isinstance(p, str) else decode(p)) for p in prompts]
    per_prompt = max(n, 1)
    check_echo_size(texts, per_prompt)
    return PromptEcho(texts, per_prompt, max_tokens == 0)


def echoed_message(req: ChatCompletionRequest) -> str:
    """The text a chat answer echoes: the last message's when it has the answer's role;
    EchoTooLarge."""
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last.role
    text = message_text(last) if last.role == role else ""
    check_echo_size([text], req.n)
    return text
