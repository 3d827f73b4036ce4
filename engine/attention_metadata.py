"""What the attention layers need to know about a batch: built once per step by the runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, slot of each new token (-1: do not write)
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context length including the new tokens
    max_query_len: int
    max_seq_len: int
    # Per sequence: 0 when it is a pure decode step (one new token). Lets the torch path
    # batch decodes together.
    query_lens: list[int]
    # Recurrent-state models: each sequence's state slot, and whether that slot already
    # holds the state after its computed tokens (False: start from zeros).
    state_slots: Optional[torch.Tensor] = None  # [B] int64
    state_has_initial: Optional[list[bool]] = None
    # Hybrid models: (slot_mapping, block_tables) of every KV group after the first.
    extra_groups: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None

    def group_tables(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        if group == 0:
            return self.slot_mapping, self.block_tables
        return self.extra_groups[group - 1]
