"""The output processor: incremental text, stop strings across token boundaries,
include_stop_str_in_output, held-back text (the tiny checkpoint's real tokenizer)."""

from __future__ import annotations

from typing import Optional

import pytest
from transformers import AutoTokenizer

from pdpool.engine.output_processor import OutputProcessor, find_stop
from pdpool.engine.request import Request, RequestStatus
from pdpool.engine.sampling_params import SamplingParams
from pdpool.engine.stop_check import check_stop

TEXT = "The quick brown fox jumps over the lazy dog, then naps."
STOPPED, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    return AutoTokenizer.from_pretrained(str(tiny_qwen3))


@pytest.fixture(scope="module")
def text_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT and len(ids) > 8
    return ids


def _run(tokenizer, outputs, eos=(), **params):
    """Feeds `outputs` one token at a time as the engine does; returns the deltas, the final
    status and how many tokens were taken."""
    deltas, status, taken, _ = _run_to_reason(tokenizer, outputs, eos, **params)
    return deltas, status, taken


def _run_to_reason(tokenizer, outputs, eos=(), **params):
    """_run's results and the request's stop_reason."""
    proc = OutputProcessor(tokenizer)
    req = Request("r", tokenizer.encode("Hi:"), SamplingParams(**params), eos_token_ids=eos)
    proc.add(req)
    deltas: list[str] = []
    status: Optional[RequestStatus] = None
    for token in outputs:
        req.append_output_token(token)
        text, status = proc.process(req, check_stop(req, 10_000))
        deltas.append(text)
        if status is not None:
            break
    proc.forget("r")
    assert len(proc) == 0
    return deltas, status, len(req.output_token_ids), req.stop_reason


def _token_ending_at(tokenizer, ids: list[int], end: int) -> int:
    """How many tokens it takes for the text to reach character `end`."""
    return next(n for n in range(1, len(ids) + 1) if len(tokenizer.decode(ids[:n])) >= end)


def test_the_deltas_join_into_the_text(tokenizer, text_ids):
    deltas, status, taken = _run(tokenizer, text_ids, max_tokens=len(text_ids))
    assert "".join(deltas) == TEXT and status is LENGTH and taken == len(text_ids)
    assert sum(1 for d in deltas if d) > 4  # incremental, not all at the end


@pytest.mark.parametrize("stop", ["k bro", "fox jumps o", "."])
def test_a_stop_string_across_tokens_cuts_the_text_where_it_begins(tokenizer, text_ids, stop):
    deltas, status, taken = _run(tokenizer, text_ids, max_tokens=100, stop=[stop])
    assert status is STOPPED
    assert "".join(deltas) == TEXT[: TEXT.index(stop)]
    # It ends with the token that completed the stop string, not later.
    assert taken == _token_ending_at(tokenizer, text_ids, TEXT.index(stop) + len(stop))
    # Nothing of the stop string was ever streamed, even while it was still incomplete.
    for n in range(1, len(deltas) + 1):
        assert len("".join(deltas[:n])) <= TEXT.index(stop)


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer, text_ids):
    stop = "k bro"
    deltas, status, _ = _run(
        tokenizer, text_ids, max_tokens=100, stop=[stop], include_stop_str_in_output=True
    )
    assert status is STOPPED
    assert "".join(deltas) == TEXT[: TEXT.index(stop) + len(stop)]


def test_the_earliest_stop_string_wins(tokenizer, text_ids):
    deltas, status, _ = _run(tokenizer, text_ids, max_tokens=100, stop=["lazy", "fox"])
    assert status is STOPPED and "".join(deltas) == TEXT[: TEXT.index("fox")]


def test_a_stop_string_beats_the_length_on_the_same_token(tokenizer, text_ids):
    n = _token_ending_at(tokenizer, text_ids, TEXT.index("fox") + 3)
    deltas, status, _ = _run(tokenizer, text_ids, max_tokens=n, stop=["fox"])
    assert status is STOPPED and "".join(deltas) == TEXT[: TEXT.index("fox")]


def test_stop_strings_wait_for_min_tokens(tokenizer, text_ids):
    early = _token_ending_at(tokenizer, text_ids, TEXT.index("quick") + 5)
    deltas, status, _ = _run(
        tokenizer, text_ids, max_tokens=100, min_tokens=early + 1, stop=["quick", "lazy"]
    )
    assert status is STOPPED and "".join(deltas) == TEXT[: TEXT.index("lazy")]


def test_a_stop_token_leaves_its_text_out_unless_asked(tokenizer, text_ids):
    stop_at = 5
    tokens = text_ids[: stop_at + 3]
    stop_id = tokens[stop_at]
    assert stop_id not in tokens[:stop_at]
    before = tokenizer.decode(tokens[:stop_at])
    deltas, status, taken = _run(tokenizer, tokens, max_tokens=100, stop_token_ids=[stop_id])
    assert (status, taken, "".join(deltas)) == (STOPPED, stop_at + 1, before)
    deltas, status, _ = _run(
        tokenizer, tokens, max_tokens=100, stop_token_ids=[stop_id], include_stop_str_in_output=True
    )
    assert "".join(deltas) == tokenizer.decode(tokens[: stop_at + 1])


def test_an_eos_ends_the_text_and_flushes_what_was_held(tokenizer, text_ids):
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    tokens = [*text_ids[:6], eos]
    deltas, status, _ = _run(tokenizer, tokens, eos=(eos,), max_tokens=100, stop=["zzzzzz"])
    assert status is STOPPED and "".join(deltas) == tokenizer.decode(text_ids[:6])
    assert deltas[-1] != ""  # held back while it could begin "zzzzzz", flushed at the end


def test_the_stop_reason_names_the_stop_string_or_token_that_ended_it(tokenizer, text_ids):
    # as vLLM's stop_reason: the matched string (the first listed of those starting at the
    # earliest place), the stop token id; None for the tokenizer's EOS and for a length
    *_, reason = _run_to_reason(tokenizer, text_ids, max_tokens=100, stop=["lazy", "fox"])
    assert reason == "fox"
    *_, reason = _run_to_reason(
        tokenizer, text_ids, max_tokens=100, stop=["fox"], include_stop_str_in_output=True
    )
    assert reason == "fox"
    stop_id = text_ids[4]
    *_, reason = _run_to_reason(tokenizer, text_ids, max_tokens=100, stop_token_ids=[stop_id])
    assert reason == stop_id
    eos = tokenizer.eos_token_id
    *_, status, _, reason = _run_to_reason(
        tokenizer, [*text_ids[:3], eos], eos=(eos,), max_tokens=9
    )
    assert (status, reason) == (STOPPED, None)
    *_, status, _, reason = _run_to_reason(tokenizer, text_ids, max_tokens=3, stop=["zzz"])
    assert (status, reason) == (LENGTH, None)


def test_find_stop_searches_only_where_new_text_completes_one():
    assert find_stop("abcdef", 1, ["ab"]) is None  # "ab" ended before the new character
    assert find_stop("abcdef", 5, ["ab"]) == (0, 2)
    assert find_stop("abcdef", 2, ["de", "ef"]) == (3, 5)
    assert find_stop("abcdef", 3, []) is None


def test_find_stop_takes_the_stop_that_completes_first_as_one_character_at_a_time_would():
    # A token bringing "abc" at once: written char by char, "b" completes before "abc".
    assert find_stop("abc", 3, ["abc", "b"]) == (1, 2)
    assert find_stop("xabc", 3, ["bc", "abc"]) == (2, 4)  # both end there: the first listed
    assert find_stop(" on", 3, [" ", "e"]) == (0, 1)
