"""Whether a request ends with the token it was just given: the token-level stop rules.

The scheduler applies them as it appends each sampled token (as vLLM's
v1/core/sched/utils.check_stop); text-level stops (stop strings) need the detokenized text
and are the output processor's (output_processor.py). Pure: reads the request, changes
nothing.
"""

from __future__ import annotations

from typing import Optional

from pdpool.engine.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> Optional[RequestStatus]:
    """FINISHED_STOPPED when the last output token ends the request (a stop token id, or an
    EOS unless ignore_eos, both only once min_tokens are out; or an ended grammar, which
    allows no further token even short of min_tokens), FINISHED_LENGTH when max_tokens or
    the context is used up, None while it goes on. A stop token wins over the length: it
    is reported as a stop (and its text left out)."""
    params = request.sampling_params
    token = request.output_token_ids[-1]
    num_output = len(request.output_token_ids)
    if request.grammar is not None and request.grammar.terminated:
        return RequestStatus.FINISHED_STOPPED
    by_token = token in params.stop_token_ids or (
        token in request.eos_token_ids and not params.ignore_eos
    )
    if by_token and num_output >= params.min_tokens:
        return RequestStatus.FINISHED_STOPPED
    if num_output >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def stop_token_reason(request: Request, tokenizer_eos: Optional[int]) -> Optional[int]:
    """The token id a request that its last token stopped reports as `stop_reason`, as vLLM
    does: a stop token id, the checkpoint's extra end-of-sequence ids among them (vLLM folds
    generation_config's into the stop token ids); None for the tokenizer's own EOS (unless
    ignore_eos made it an ordinary token) and for the last token of an ended grammar."""
    params = request.sampling_params
    token = request.output_token_ids[-1]
    if token == tokenizer_eos and not params.ignore_eos:
        return None
    if token in params.stop_token_ids or (token in request.eos_token_ids and not params.ignore_eos):
        return token
    return None
