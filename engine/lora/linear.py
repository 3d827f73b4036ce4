"""A linear layer with LoRA slots: the base projection, plus each token's adapter's
low-rank update (kernels/ops.lora_apply), as the current step's batch says."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from pdpool.kernels import ops
from pdpool.kernels.lora_reference import lora_runs


@dataclass
class LoRABatch:
    """One step's adapter mapping, shared by every LoRA layer: each token's slot (-1: the
    base model), and the CPU path's column mask (kernels/lora_reference.slot_mask)."""

    token_slots: torch.Tensor  # [T] int64
    mask: Optional[torch.Tensor]  # [T, S * R], None on CUDA and with runs
    # CPU, long runs of one adapter's tokens (prompt chunks): (start, end, slot) each
    # computed with its own slot (kernels/lora_reference.lora_runs), instead of the mask.
    runs: Optional[list[tuple[int, int, int]]] = None


class StepLoRA:
    """Where the runner puts this step's LoRABatch (None: no adapter in the batch, every
    layer runs its base projection alone)."""

    def __init__(self) -> None:
        self.batch: Optional[LoRABatch] = None


class LoRALinear(nn.Module):
    """Wraps a linear (nn.Linear or the CPU PackedLinear). `a` [S * R, in] and `b`
    [out, S * R] hold every slot's weights (B scaled); the manager (slots.py) fills them."""

    def __init__(
        self, base: nn.Module, num_slots: int, max_rank: int, step: StepLoRA, dtype, device
    ):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank = max_rank
        self.step = step
        self.register_buffer(
            "a", torch.zeros(num_slots * max_rank, self.in_features, dtype=dtype, device=device)
        )
        self.register_buffer(
            "b", torch.zeros(self.out_features, num_slots * max_rank, dtype=dtype, device=device)
        )

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.step.batch
        if batch is None:
            return y
        lead = y.shape[:-1]
        flat_y = y.reshape(-1, self.out_features)
        if batch.runs is not None:
            flat_x = x.reshape(-1, self.in_features)
            lora_runs(flat_y, flat_x, self.a, self.b, batch.runs, self.rank)
            return flat_y.view(*lead, self.out_features)
        ops.lora_apply(
            flat_y,
            x.reshape(-1, self.in_features),
            self.a,
            self.b,
            batch.token_slots,
            self.rank,
            batch.mask,
        )
        return flat_y.view(*lead, self.out_features)

    def set_slot(self, slot: int, a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> None:
        """Writes one adapter's A [r, in] and scaled B [out, r] into `slot` (zeros past its
        rank; None: the adapter leaves this layer alone)."""
        rows = slice(slot * self.rank, (slot + 1) * self.rank)
        self.a[rows].zero_()
        self.b[:, rows].zero_()
        if a is not None and b is not None:
            r = a.shape[0]
            self.a[slot * self.rank : slot * self.rank + r].copy_(a)
            self.b[:, slot * self.rank : slot * self.rank + r].copy_(b)
