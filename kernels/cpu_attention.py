"""The engine's attention on CPU: the C kernels where they serve the step (built on first use,
see native_build.py), the torch reference otherwise (another dtype, a head size they do
not serve, no compiler, or turned off by their environment variables).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import cpu_decode_attention, cpu_prefill_attention
from .reference import paged_attention_reference


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """`reference.paged_attention_reference`'s arguments and result."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    pure_decode = len(decodes) == len(lens) == q.shape[0]
    if pure_decode and cpu_decode_attention.usable_for(q, k_cache, v_cache):
        # A pure decode step: read the paged cache in place.
        return cpu_decode_attention.paged_decode_attention(
            q, k_cache, v_cache, block_tables, lens, scale, sliding_window
        )
    if not pure_decode and cpu_prefill_attention.usable_for(q, k_cache, v_cache):
        # Prefill chunks: one flash-style call for the whole batch, the cache read in
        # place; the decodes beside them go to the decode kernel (half the time of the
        # prefill kernel's mostly empty tiles for 16 decodes of 1000-3000).
        return _cpu_kernels(
            q, k_cache, v_cache, block_tables, starts, lens, decodes, scale, sliding_window
        )
    return paged_attention_reference(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window
    )


def _cpu_kernels(q, k_cache, v_cache, block_tables, starts, lens, decodes, scale, window):
    """A step with prefill chunks through the prefill kernel, its decodes (if any) through
    the decode kernel."""
    split = bool(decodes) and cpu_decode_attention.usable_for(q, k_cache, v_cache)
    out = cpu_prefill_attention.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, starts, lens, scale, window, skip_single=split
    )
    if split:
        rows = torch.tensor([starts[b] for b in decodes])
        decoded = cpu_decode_attention.paged_decode_attention(
            q.index_select(0, rows),
            k_cache,
            v_cache,
            block_tables.index_select(0, torch.tensor(decodes)),
            [lens[b] for b in decodes],
            scale,
            window,
        )
        out.index_copy_(0, rows, decoded)
    return out
