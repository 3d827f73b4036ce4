"""allowed_token_ids (engine/allowed_tokens.py) through the sampler: greedy and sampled rows
keep to the list, other rows are untouched, and bad lists are refused by name. Against vLLM:
tests/vllm/test_vllm_engine.py."""

from __future__ import annotations

import pytest
import torch

from pdpool.engine.sampling import Sampler
from pdpool.engine.sampling_params import SamplingParams

VOCAB = 32


def test_rows_keep_to_their_allowed_tokens_and_others_are_untouched():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    logits[:, 7] = 50.0  # everyone's favourite
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=[3, 11])
    sampled = SamplingParams(temperature=1.0, seed=5, allowed_token_ids=[4, 9, 20])
    plain = SamplingParams(temperature=0.0)
    sampler = Sampler()
    seen = set()
    for _ in range(30):
        res = sampler.sample(logits.clone(), ["g", "s", "p"], [greedy, sampled, plain], [None] * 3)
        assert res.tokens[0] == max((3, 11), key=lambda t: logits[0, t].item())
        assert res.tokens[2] == 7 and not res.errors
        seen.add(res.tokens[1])
    assert seen <= {4, 9, 20} and len(seen) > 1


def test_a_forgotten_request_leaves_no_mask_behind():
    sampler = Sampler()
    params = SamplingParams(temperature=0.0, allowed_token_ids=[1])
    sampler.sample(torch.zeros(1, VOCAB), ["r"], [params], [None])
    sampler.forget("r")
    assert not sampler.allowed_tokens._masks


@pytest.mark.parametrize("ids", [[], [VOCAB], [-1], [1.5], [True], [1] * 16385])
def test_bad_lists_are_refused_by_name(ids):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=ids).validate(VOCAB)
