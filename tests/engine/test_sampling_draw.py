"""The sampler's random draw: one inverse-CDF draw for the whole batch, rows with only a
temperature normalized together, seeded rows on their own generators."""

from __future__ import annotations

import math

import torch

from pdpool.engine.sampling import Sampler, inverse_cdf_draw
from pdpool.engine.sampling_filters import TOP_P_CANDIDATES, keep_top_p, sampling_weights
from pdpool.engine.sampling_params import SamplingParams

BELOW_ONE = math.nextafter(1.0, 0.0)


def test_the_draw_never_lands_on_a_token_of_zero_weight():
    weights = torch.tensor([[0.0, 0.0, 2.0, 0.0, 1.0, 0.0], [0.0, 3.0, 0.0, 0.0, 0.0, 0.0]])
    for u in (0.0, 1e-12, 0.5, 2 / 3, 0.7, BELOW_ONE):
        picked = inverse_cdf_draw(weights.clone(), torch.tensor([u, u])).tolist()
        assert weights[0, picked[0]] > 0 and picked[1] == 1, (u, picked)
    # Unnormalized weights: the cut falls at 2/3 of the total.
    assert inverse_cdf_draw(weights[:1].clone(), torch.tensor([0.66])).tolist() == [2]
    assert inverse_cdf_draw(weights[:1].clone(), torch.tensor([0.67])).tolist() == [4]


def test_a_target_rounded_onto_the_total_takes_the_last_token_of_weight():
    weights = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    # A uniform of exactly 1 is never drawn; it stands for rounding up to the total.
    assert inverse_cdf_draw(weights, torch.tensor([1.0])).tolist() == [1]


def test_a_row_without_a_finite_distribution_is_refused_alone():
    weights = torch.tensor([[0.5, float("nan"), 0.5], [0.0, 0.0, 0.0], [0.2, 0.3, 0.5]])
    assert inverse_cdf_draw(weights, torch.tensor([0.5, 0.5, 0.9])).tolist() == [-1, -1, 2]
    logits = torch.tensor([[0.0, float("nan"), 1.0], [0.0, 1.0, 2.0]])
    result = Sampler().sample(logits, ["nan", "ok"], [SamplingParams()] * 2, [None, None])
    assert set(result.errors) == {0} and result.tokens[1] in (0, 1, 2)


def frequencies(tokens: list[int], vocab: int) -> list[float]:
    return [tokens.count(t) / len(tokens) for t in range(vocab)]


def test_each_row_follows_its_own_distribution_in_a_mixed_batch():
    """Plain rows at two temperatures, a top-p row and a top-k row, sampled together:
    every row's frequencies match its own filtered softmax."""
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    rows = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=2.0, top_k=3),
    ]
    expected = [
        torch.softmax(logits, -1),
        torch.softmax(logits / 0.5, -1),
        None,
        torch.softmax(torch.cat([logits[:3] / 2.0, torch.full((3,), -math.inf)]), -1),
    ]
    p = torch.softmax(logits, -1)  # top-p 0.6 keeps the first tokens whose mass before < 0.6
    kept = int((p.cumsum(-1) - p < 0.6).sum())
    expected[2] = torch.cat([p[:kept] / p[:kept].sum(), torch.zeros(6 - kept)])
    sampler = Sampler()
    draws: list[list[int]] = [[] for _ in rows]
    ids = [f"r{i}" for i in range(len(rows))]
    for _ in range(20000):
        out = sampler.sample(logits.repeat(len(rows), 1), ids, rows, [None] * len(rows))
        assert not out.errors
        for i, token in enumerate(out.tokens):
            draws[i].append(token)
    for i, want in enumerate(expected):
        got = frequencies(draws[i], 6)
        for t in range(6):
            # 20000 draws: a standard error under 0.0036; 5 of them.
            assert abs(got[t] - float(want[t])) < 0.018, (i, t, got, want.tolist())
            if float(want[t]) == 0.0:
                assert got[t] == 0.0, (i, t, got)


def test_a_seeded_row_draws_the_same_tokens_whatever_its_batch():
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler()
    crowd = Sampler()
    others = [SamplingParams(temperature=0.7), SamplingParams(top_p=0.9), SamplingParams()]
    ids = ["other-0", "seeded", "other-1", "other-2"]
    for step in range(20):
        row = logits[step % 8]
        lone = alone.sample(row[None].clone(), ["seeded"], [seeded], [None]).tokens[0]
        batch = torch.stack([logits[(step + 1) % 8], row, logits[(step + 2) % 8], row])
        params = [others[0], seeded, others[1], others[2]]
        together = crowd.sample(batch, ids, params, [None] * 4).tokens[1]
        assert lone == together, step


def top_p_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    values, order = probs.sort(descending=True)
    keep = values.cumsum(-1) - values < top_p
    keep[0] = True
    return torch.zeros_like(probs).scatter(0, order[keep], values[keep])


def test_top_p_keeps_the_same_tokens_as_a_full_sort():
    """Whether the kept tokens lie among the first candidates (a peaked distribution) or
    not (a flat one, where the row is sorted whole), at the vocabulary's size and around
    it, with rows of different top_p in one batch."""
    gen = torch.Generator().manual_seed(9)
    tops = [0.05, 0.5, 0.9, 0.999]
    for vocab in (16, TOP_P_CANDIDATES, 5000):
        for scale in (8.0, 3.0, 0.1):  # peaked to flat
            probs = torch.softmax(torch.randn(len(tops), vocab, generator=gen) * scale, -1)
            got = probs * 3.0  # weights need not be normalized
            keep_top_p(got, tops)
            for i, top_p in enumerate(tops):
                want = top_p_by_full_sort(probs[i], top_p) * 3.0
                assert torch.equal(got[i] > 0, want > 0), (scale, vocab, top_p)
                torch.testing.assert_close(got[i], want)


def test_top_k_and_min_p_rows_pass_their_neighbours_through():
    """One filter's batch operation leaves the rows that do not use it as they were."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    params = [
        SamplingParams(top_k=3),
        SamplingParams(),
        SamplingParams(min_p=0.5, temperature=0.5),
        SamplingParams(top_k=60),  # past the vocabulary: no filter
    ]
    weights = sampling_weights(logits.clone(), params)
    assert (weights[0] > 0).sum() == 3 and (weights[1] > 0).all() and (weights[3] > 0).all()
    probs = torch.softmax(logits[2] / 0.5, -1)
    assert torch.equal(weights[2] > 0, probs >= 0.5 * probs.max())
    torch.testing.assert_close(weights[1] / weights[1].sum(), torch.softmax(logits[1], -1))


def test_a_sampled_tokens_logprob_carries_its_rank_as_vllm_counts_it():
    # rank: how many tokens are at least as likely, itself included (ties count)
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0], [0.0, 5.0, 1.0, 1.0, 1.0]])
    params = [
        SamplingParams(logprobs=1, allowed_token_ids=[3]),  # forced to the third likeliest
        SamplingParams(logprobs=0, temperature=0.0),
    ]
    result = Sampler().sample(logits, ["a", "b"], params, [None, None])
    first, second = result.logprobs
    assert (first.token_id, first.rank) == (3, 3) and first.top[0][0] == 0
    assert (second.token_id, second.rank, second.top) == (1, 1, [])
