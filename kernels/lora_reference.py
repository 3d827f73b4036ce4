"""LoRA over a batch mixing adapters, in torch: the reference for the Triton kernels, and
the CPU path.

Adapter weights live in slots: `a` is `[S * R, in]` (slot s holds its A in rows
s*R..s*R+R-1, zero-padded past its rank) and `b` is `[out, S * R]` (B scaled by
alpha / r, in the same columns). Each token names its slot (`token_slots`, -1: no adapter),
and gets `y[t] += (x[t] @ A_s.T) @ B_s.T`.
"""

from __future__ import annotations

import torch


def lora_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    rank: int,
) -> torch.Tensor:
    """Slot by slot, the obvious way (adds into `y` and returns it)."""
    for s in range(a.shape[0] // rank):
        rows = (token_slots == s).nonzero(as_tuple=True)[0]
        if rows.numel():
            a_s = a[s * rank : (s + 1) * rank].float()
            b_s = b[:, s * rank : (s + 1) * rank].float()
            y[rows] += ((x[rows].float() @ a_s.T) @ b_s.T).to(y.dtype)
    return y


def slot_mask(token_slots: torch.Tensor, num_slots: int, rank: int, dtype: torch.dtype):
    """`[T, S * R]`: 1 in the R columns of each token's slot, 0 elsewhere (all 0 for -1)."""
    cols = torch.arange(num_slots * rank, device=token_slots.device) // rank
    return (cols.unsqueeze(0) == token_slots.unsqueeze(1)).to(dtype)


def lora_masked(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Every slot at once: two dense matmuls, the other slots' columns masked to zero.
    On CPU, with a few small-rank slots, this beats gathering per token or per slot
    (one oneDNN call each, whatever the mix). `mask` is `slot_mask` (built once a step)."""
    h = x @ a.T
    h.mul_(mask)
    return y.addmm_(h, b.T)


# A step whose adapter tokens come in runs at least this long on average (prompt chunks)
# computes each run with its own slot's A and B: 1/S of the masked form's work, for two
# calls per run. Shorter runs (decode: a token per request) keep the masked form.
RUN_MIN_TOKENS = 32


def slot_runs(request_slots: list[int], num_tokens: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, slot) of each run of consecutive tokens under one adapter (a request's
    tokens are contiguous in the step; neighbours under the same adapter merge)."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for slot, n in zip(request_slots, num_tokens, strict=True):
        end = start + n
        if slot >= 0 and n > 0:
            if runs and runs[-1][1] == start and runs[-1][2] == slot:
                runs[-1] = (runs[-1][0], end, slot)
            else:
                runs.append((start, end, slot))
        start = end
    return runs


def lora_runs(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    runs: list[tuple[int, int, int]],
    rank: int,
) -> torch.Tensor:
    """Run by run, each with its slot's own A and B (views: nothing is gathered)."""
    for start, end, s in runs:
        h = x[start:end] @ a[s * rank : (s + 1) * rank].T
        y[start:end].addmm_(h, b[:, s * rank : (s + 1) * rank].T)
    return y
