"""vLLM's sampling penalties on one row of logits, before the greedy choice or temperature:

    repetition  a token seen in the prompt or the output: a positive logit divided by the
                penalty, a negative one multiplied by it;
    frequency   minus the penalty times the token's count in the output;
    presence    minus the penalty once the token is in the output.

The same arithmetic as vLLM's torch path (a multiplication by 1 / penalty, float32), so that
greedy tokens match it.
"""

from __future__ import annotations

import torch

from pdpool.engine.sampling_params import SamplingParams


def apply_penalties(
    row: torch.Tensor, prompt_ids: list[int], output_ids: list[int], params: SamplingParams
) -> None:
    """Applies the penalties of `params` to `row` ([V] float32) in place."""
    vocab = row.shape[-1]
    device = row.device
    counts = torch.zeros(vocab, dtype=torch.float32, device=device)
    if output_ids:
        counts.index_add_(
            0,
            torch.tensor(output_ids, dtype=torch.long, device=device).clamp_(0, vocab - 1),
            torch.ones(len(output_ids), dtype=torch.float32, device=device),
        )
    in_output = counts > 0
    if params.repetition_penalty != 1.0:
        seen = in_output.clone()
        if prompt_ids:
            prompt = torch.tensor(prompt_ids, dtype=torch.long, device=device)
            seen[prompt.clamp_(0, vocab - 1)] = True
        penalty = torch.where(seen, params.repetition_penalty, 1.0)
        row *= torch.where(row > 0, 1.0 / penalty, penalty)
    if params.frequency_penalty:
        row -= params.frequency_penalty * counts
    if params.presence_penalty:
        row -= params.presence_penalty * in_output.float()
