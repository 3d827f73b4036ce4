"""vLLM's sampling penalties and min_p (engine/penalties.py) on hand-made logits, and through
the sampler: they change the greedy choice as the formulas say, and only for the rows that
ask. Against vLLM itself: tests/vllm/test_vllm_engine.py."""

from __future__ import annotations

import pytest
import torch

from pdpool.engine.penalties import apply_penalties
from pdpool.engine.sampling_filters import drop_below_min_p
from pdpool.engine.sampling import Sampler
from pdpool.engine.sampling_params import SamplingParams

LOGITS = [2.0, -1.0, 0.5, 3.0, -0.5, 1.0]


def _penalized(prompt: list[int], output: list[int], **params) -> list[float]:
    row = torch.tensor(LOGITS)
    apply_penalties(row, prompt, output, SamplingParams(**params))
    return row.tolist()


def test_repetition_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    got = _penalized([0, 1], [3], repetition_penalty=2.0)
    assert got == pytest.approx([1.0, -2.0, 0.5, 1.5, -0.5, 1.0])
    # below 1 it favours what was seen
    assert _penalized([4], [], repetition_penalty=0.5)[4] == pytest.approx(-0.25)


def test_frequency_counts_output_tokens_and_presence_counts_them_once():
    got = _penalized([2], [3, 3, 5], frequency_penalty=0.5)
    assert got == pytest.approx([2.0, -1.0, 0.5, 2.0, -0.5, 0.5])  # the prompt's 2 untouched
    got = _penalized([2], [3, 3, 5], presence_penalty=0.5)
    assert got == pytest.approx([2.0, -1.0, 0.5, 2.5, -0.5, 0.5])
    got = _penalized([], [3, 3], presence_penalty=-1.0, frequency_penalty=1.0)
    assert got[3] == pytest.approx(3.0 + 1.0 - 2.0)


def test_min_p_drops_tokens_below_its_share_of_the_likeliest():
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    rows = row.repeat(3, 1)
    drop_below_min_p(rows, [0.25, 0.0, 1.0])
    kept = rows.isfinite().tolist()
    assert kept[0] == [True, True, True, False]  # 0.05 < 0.25 * 0.5
    assert all(kept[1])
    assert kept[2] == [True, False, False, False]


def test_the_sampler_penalizes_only_the_rows_that_ask_and_before_the_greedy_choice():
    logits = torch.tensor([LOGITS, LOGITS])
    plain = SamplingParams(temperature=0.0)
    penalized = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    res = Sampler().sample(logits, ["a", "b"], [plain, penalized], [None, None], [None, ([0], [3])])
    assert res.tokens == [3, 0] and not res.errors  # 3: 3.0 - 2.0 < 2.0


def test_min_p_leaves_only_the_likeliest_token_when_it_is_one():
    logits = torch.tensor([[0.0, 5.0, 4.9, 1.0]])
    params = SamplingParams(temperature=1.0, min_p=1.0, seed=3)
    sampler = Sampler()
    tokens = {sampler.sample(logits.clone(), ["r"], [params], [None]).tokens[0] for _ in range(20)}
    assert tokens == {1}


@pytest.mark.parametrize(
    "field,value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("repetition_penalty", float("nan")),
        ("min_p", 1.5),
        ("min_p", "0.1"),
    ],
)
def test_out_of_range_penalties_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()
