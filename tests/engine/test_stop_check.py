"""The token-level stop rules (stop_check.check_stop), as the scheduler applies them, and the
stop_reason a token stop reports (stop_check.stop_token_reason)."""

from __future__ import annotations

from typing import Optional

import pytest

from pdpool.engine.request import Request, RequestStatus
from pdpool.engine.sampling_params import SamplingParams
from pdpool.engine.stop_check import check_stop, stop_token_reason

EOS = 2
EXTRA_EOS = 0  # a generation_config end-of-sequence id beside the tokenizer's
STOPPED, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH


def _after(outputs: list[int], max_model_len: int = 100, **params) -> Optional[RequestStatus]:
    req = Request("r", [10, 11, 12], SamplingParams(**params), eos_token_ids=(EOS,))
    for t in outputs:
        req.append_output_token(t)
    return check_stop(req, max_model_len)


def test_a_plain_token_goes_on():
    assert _after([5], max_tokens=4) is None


def test_eos_stops_unless_ignored():
    assert _after([5, EOS], max_tokens=8) is STOPPED
    assert _after([5, EOS], max_tokens=8, ignore_eos=True) is None


def test_stop_token_ids_stop_even_with_ignore_eos():
    assert _after([7], max_tokens=8, stop_token_ids=[7]) is STOPPED
    assert _after([7], max_tokens=8, stop_token_ids=[7], ignore_eos=True) is STOPPED
    assert _after([8], max_tokens=8, stop_token_ids=[7]) is None


def test_min_tokens_hold_back_stop_tokens_but_not_the_length():
    assert _after([EOS], max_tokens=8, min_tokens=2) is None
    assert _after([5, EOS], max_tokens=8, min_tokens=2) is STOPPED
    assert _after([7, 7], max_tokens=2, min_tokens=3, stop_token_ids=[7]) is LENGTH


def test_max_tokens_and_the_context_end_it_by_length():
    assert _after([5, 6], max_tokens=2) is LENGTH
    assert _after([5], max_tokens=8, max_model_len=4) is LENGTH  # 3 prompt + 1 output
    assert _after([5], max_tokens=8, max_model_len=5) is None


def test_a_stop_token_at_the_length_limit_is_a_stop():
    assert _after([5, EOS], max_tokens=2) is STOPPED


def _reason(outputs: list[int], **params) -> Optional[int]:
    req = Request("r", [10, 11, 12], SamplingParams(**params), eos_token_ids=(EXTRA_EOS, EOS))
    for t in outputs:
        req.append_output_token(t)
    return stop_token_reason(req, tokenizer_eos=EOS)


def test_a_stop_token_id_is_the_stop_reason():
    assert _reason([5, 7], max_tokens=8, stop_token_ids=[7]) == 7
    assert _reason([5, 7], max_tokens=8, stop_token_ids=[7], ignore_eos=True) == 7


def test_the_tokenizers_eos_has_no_stop_reason_but_the_checkpoints_other_eos_ids_do():
    # vLLM folds generation_config's extra EOS ids into the stop token ids
    assert _reason([5, EOS], max_tokens=8) is None
    assert _reason([5, EXTRA_EOS], max_tokens=8) == EXTRA_EOS


def test_a_token_that_is_no_stop_token_has_no_stop_reason():
    # the last token of an ended grammar, or an EOS that ignore_eos made ordinary
    assert _reason([5, 9], max_tokens=8, stop_token_ids=[7]) is None
    assert _reason([5, EXTRA_EOS], max_tokens=8, ignore_eos=True) is None
    assert _reason([5, EOS], max_tokens=8, ignore_eos=True, stop_token_ids=[EOS]) == EOS


def test_stop_token_id_lists_are_capped():
    # a stop check scans the list every step: one body must not slow every step
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[7] * 1025).validate()
    SamplingParams(stop_token_ids=[7] * 1024).validate()
