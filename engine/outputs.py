"""What an engine gives back, in types that need no torch: the HTTP process (which never
imports torch) and the engine core share them; and how a reader that fell behind merges a
request's outputs that wait for it (mergeable_runs, merge_deltas)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Union


class RequestRejected(ValueError):
    """A request the engine can never serve (too long, cannot fit the KV cache)."""


class KVTransferRefused(RuntimeError):
    """Under the `fail` load-failure policy: kv_transfer_params that cannot be trusted."""


class RequestError(ValueError):
    """A failure caused by one request's own parameters (answered 400, not 500)."""


@dataclass
class TokenLogprob:
    """A token's logprob, its rank (how many tokens are at least as likely, itself
    included, as vLLM counts) and the `top` most likely (id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: Optional[int] = None


@dataclass
class RequestOutput:
    request_id: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: Optional[str]
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    kv_transfer_params: Optional[dict[str, Any]] = None
    error: Optional[str] = None
    # The HTTP status an error maps to (None: the caller decides, e.g. 503 for KV loads).
    error_status: Optional[int] = None
    # Aligned with new_token_ids when the request asked for logprobs.
    logprobs: Optional[list[TokenLogprob]] = None
    # Of num_cached_tokens, those loaded from a peer (the rest were local hits).
    num_pulled_tokens: int = 0
    # time.monotonic() when the step that made it ended (set on delivery; latency metrics).
    produced_at: float = 0.0
    # On a final output: the core's RequestPhases (queue, KV load, prefill, decode times).
    phases: Optional[RequestPhases] = None
    # On a final output: the stop string or stop token id that ended it (vLLM's stop_reason).
    stop_reason: Union[int, str, None] = None
    # On the first output of a request that asked for prompt_logprobs: those of prompt
    # tokens 1.. (the first has none), each with its rank.
    prompt_logprobs: Optional[list[TokenLogprob]] = None


@dataclass
class RequestPhases:
    """When a request moved on in the engine core, in time.monotonic() (the same clock in
    the server process): arrived, admitted (left the queue: to load KV from a peer or to
    run), running (computing: its KV is here), its first token. The server turns them into
    vLLM's phase histograms and a trace's spans."""

    arrived: float
    admitted: Optional[float] = None
    running: Optional[float] = None
    first_token: Optional[float] = None


def prompt_fit_problem(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, kv_capacity_tokens: int
) -> Optional[str]:
    """Why a request of this size can never run here (None: it can). The server checks it
    before a request reaches the engine core; the core checks it again."""
    if num_prompt_tokens == 0:
        return "the prompt is empty"
    total = num_prompt_tokens + max_tokens
    if total > kv_capacity_tokens:
        return (
            f"the request ({num_prompt_tokens} prompt + {max_tokens} output tokens) cannot fit "
            f"in the KV cache even alone: it holds {kv_capacity_tokens} tokens"
        )
    if total > max_model_len:
        return (
            f"this model's maximum context length is {max_model_len} tokens; the request "
            f"asks for {num_prompt_tokens} prompt + {max_tokens} output tokens"
        )
    return None


class EngineBusy(RuntimeError):
    """The engine cannot take this request now (its grammar compile slots are held), and a
    retry or another engine may: answered 503, like EngineUnavailable, but the engine is
    healthy."""


class EngineUnavailable(RuntimeError):
    """The engine core is not there to serve (it exited and is being restarted, or the server
    is stopping): a retryable failure, answered 503."""


def mergeable_runs(outputs: list[RequestOutput]) -> list[list[RequestOutput]]:
    """Consecutive outputs cut where tokens whose text is held back (an incomplete UTF-8
    sequence, a possible stop string) follow tokens whose text was emitted, and before an
    error. A merged output with text then covers its tokens' text as a single one does, which
    a reader that takes them as complete relies on (the gateway resumes a broken stream after
    those tokens); the tokens before an error are sent before it."""
    runs: list[list[RequestOutput]] = []
    run: list[RequestOutput] = []
    run_has_text = False
    for out in outputs:
        if run and (out.finish_reason == "error" or (run_has_text and not out.new_text)):
            runs.append(run)
            run, run_has_text = [], False
        run.append(out)
        run_has_text = run_has_text or bool(out.new_text)
    runs.append(run)
    return runs


def merge_deltas(outputs: list[RequestOutput]) -> RequestOutput:
    """One output for consecutive outputs of one request: their new text, token ids and
    logprobs joined; everything else (counts, finish, errors, times) as of the last."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    logprobs = None
    if any(o.logprobs for o in outputs):
        logprobs = [lp for o in outputs for lp in (o.logprobs or ())]
    return replace(
        last,
        new_text="".join(o.new_text for o in outputs),
        new_token_ids=[t for o in outputs for t in o.new_token_ids],
        logprobs=logprobs,
        prompt_logprobs=outputs[0].prompt_logprobs,  # only a request's first has them
    )
