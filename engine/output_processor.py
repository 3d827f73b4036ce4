"""From sampled tokens to what a request's stream says: detokenizing, stop strings, outputs.

The scheduler has already applied the token-level stops (stop_check.py) when a token gets
here; this is where the text is made and the text-level stops are found (as vLLM's
v1/engine/output_processor.py with its detokenizer), in the engine core, so that every
client (in-process or not) gets outputs with their text. One IncrementalDetokenizer per
request in flight.
"""

from __future__ import annotations

from typing import Any, Optional

from pdpool.engine.detokenizer import IncrementalDetokenizer, fast_decoder
from pdpool.engine.outputs import RequestOutput, TokenLogprob
from pdpool.engine.request import Request, RequestStatus
from pdpool.engine.stop_check import stop_token_reason


def find_stop(text: str, new_len: int, stops: list[str]) -> Optional[tuple[int, int]]:
    """(start, end) of the stop string in `text` that completes first (the first listed among
    those ending there), searching only where the last `new_len` characters could complete
    one; None if none. Completing first is what a text written one character at a time would
    stop at, however many characters a token brings (vLLM's rule)."""
    best: Optional[tuple[int, int]] = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i + len(stop) < best[1]):
            best = (i, i + len(stop))
    return best


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = fast_decoder(tokenizer)  # looked up once: it is per tokenizer
        self._tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def add(self, req: Request) -> None:
        self._detok[req.request_id] = IncrementalDetokenizer(
            self.tokenizer,
            req.prompt_token_ids,
            skip_special_tokens=req.sampling_params.skip_special_tokens,
            backend=self._backend,
        )

    def forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._detok)

    def process(
        self, req: Request, token_status: Optional[RequestStatus]
    ) -> tuple[str, Optional[RequestStatus]]:
        """The text the stream may emit after the request's newest token, and how the
        request ends (None: it goes on). `token_status` is the scheduler's verdict on that
        token (stop_check.check_stop); a stop string found in the text makes it a stop
        (even when the length ran out too) and cuts the text where it begins (after it
        with include_stop_str_in_output). A stop token's own text is left out unless
        include_stop_str_in_output. While running, text that could still turn out to
        begin a stop string is held back. A stop sets the request's stop_reason."""
        params = req.sampling_params
        include_stop = params.include_stop_str_in_output
        detok = self._detok[req.request_id]
        status = token_status
        if token_status is not RequestStatus.FINISHED_STOPPED or include_stop:
            delta = detok.add_token(req.output_token_ids[-1])
            found = None
            if token_status is not RequestStatus.FINISHED_STOPPED and (
                len(req.output_token_ids) >= params.min_tokens
            ):
                found = find_stop(detok.text, len(delta), params.stop)
            if found is not None:
                req.stop_reason = detok.text[found[0] : found[1]]
                detok.text = detok.text[: found[1] if include_stop else found[0]]
                status = RequestStatus.FINISHED_STOPPED
        if token_status is RequestStatus.FINISHED_STOPPED:
            req.stop_reason = stop_token_reason(req, self._tokenizer_eos)
        hold = 0
        if status is None and params.stop and not include_stop:
            hold = max(len(s) for s in params.stop) - 1
        end = max(len(detok.text) - hold, detok.emitted)
        text, detok.emitted = detok.text[detok.emitted : end], end
        return text, status

    @staticmethod
    def running_output(
        req: Request, text: str, token: int, logprob: Optional[TokenLogprob]
    ) -> RequestOutput:
        return RequestOutput(
            req.request_id,
            text,
            [token],
            False,
            None,
            req.num_prompt_tokens,
            len(req.output_token_ids),
            (req.num_cached_tokens or 0),
            logprobs=[logprob] if logprob is not None else None,
        )

    @staticmethod
    def final_output(
        req: Request,
        text: str = "",
        tokens: Optional[list[int]] = None,
        logprob: Optional[TokenLogprob] = None,
    ) -> RequestOutput:
        """A finished request's last output (its status, kv_transfer_params and error are
        set: the scheduler has finished it)."""
        out = RequestOutput(
            req.request_id,
            text,
            tokens or [],
            True,
            req.status.value,
            req.num_prompt_tokens,
            len(req.output_token_ids),
            (req.num_cached_tokens or 0),
            req.kv_params_out,
            req.error,
            req.error_status,
        )
        out.logprobs = [logprob] if logprob is not None else None
        out.num_pulled_tokens = req.num_pulled_tokens
        out.phases = req.phases
        out.stop_reason = req.stop_reason
        return out
