"""The kernels' public API, used by the engine: Triton on CUDA, the torch references elsewhere.

`use_triton(device)` is the one switch: True on CUDA unless `PDPOOL_FORCE_TORCH=1`, which runs
the torch path on a GPU for comparison. The Triton modules are imported lazily, so the CPU
path (and anything that imports this module) never needs a working Triton backend.

Every op checks its inputs once here and raises `ValueError` with the reason; the kernel
modules assume validated inputs.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from . import gdn_reference as gdn
from . import cpu_kv_write
from .cpu_attention import paged_attention_cpu
from .lora_reference import lora_masked, slot_mask
from .reference import write_kv_reference

FORCE_TORCH_ENV = "PDPOOL_FORCE_TORCH"


def use_triton(device) -> bool:
    """Whether ops on `device` run the Triton kernels (CUDA, unless PDPOOL_FORCE_TORCH=1)."""
    if os.environ.get(FORCE_TORCH_ENV, "0").strip().lower() in ("1", "true", "yes", "on"):
        return False
    return torch.device(device).type == "cuda"


def _fail(message: str) -> None:
    raise ValueError(message)


def _check_same_device(*tensors: Optional[torch.Tensor]) -> None:
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        _fail(f"tensors are on different devices: {sorted(map(str, devices))}")


def _check_index(name: str, t: torch.Tensor, dims: int) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        _fail(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != dims:
        _fail(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        _fail(
            "k_cache and v_cache must both be [num_blocks, block_size, H_kv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )


# ----------------------------------------------------------------------------- attention


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatters k, v `[T, H_kv, D]` into the paged caches at `slot_mapping[T]`, in place.

    Caches are `[num_blocks, block_size, H_kv, D]` (strided views are fine); slot
    `block * block_size + offset`; slot -1 is skipped.
    """
    _check_cache(k_cache, v_cache)
    _check_index("slot_mapping", slot_mapping, 1)
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:]:
        _fail(
            f"k/v must be [T, H_kv, D] = [T, {k_cache.shape[2]}, {k_cache.shape[3]}], got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if slot_mapping.shape[0] != k.shape[0]:
        _fail(f"slot_mapping has {slot_mapping.shape[0]} slots for {k.shape[0]} tokens")
    _check_same_device(k, v, k_cache, v_cache, slot_mapping)
    if use_triton(k.device):
        from .kv_write import write_kv_triton

        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    elif cpu_kv_write.usable(k, v, k_cache, v_cache):
        cpu_kv_write.write_kv(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_reference(k, v, k_cache, v_cache, slot_mapping)


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    rank: int,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Adds each token's adapter's LoRA output into `y` [T, out] in place (lora_reference.py
    has the layouts): Triton on CUDA, else the masked dense form (`mask` is its slot_mask,
    built once a step; made here when not given)."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        _fail(f"x and y must be [T, in] and [T, out], got {tuple(x.shape)} and {tuple(y.shape)}")
    if rank < 1 or a.shape[0] % rank or a.shape[1] != x.shape[1]:
        _fail(f"a must be [S * {rank}, {x.shape[1]}], got {tuple(a.shape)}")
    if b.shape != (y.shape[1], a.shape[0]):
        _fail(f"b must be [{y.shape[1]}, {a.shape[0]}], got {tuple(b.shape)}")
    _check_index("token_slots", token_slots, 1)
    if token_slots.shape[0] != x.shape[0]:
        _fail(f"token_slots has {token_slots.shape[0]} entries for {x.shape[0]} tokens")
    _check_same_device(y, x, a, b, token_slots)
    if use_triton(x.device):
        from .lora_kernel import lora_triton

        return lora_triton(y, x, a, b, token_slots, rank)
    if mask is None:
        mask = slot_mask(token_slots, a.shape[0] // rank, rank, x.dtype)
    return lora_masked(y, x, a, b, mask)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
    max_query_len: Optional[int] = None,
    max_seq_len: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention of a batch mixing prefills and decodes over the paged cache.

    q `[T, H, D]` (sequence b owns rows `query_start_loc[b]:query_start_loc[b+1]`);
    caches `[num_blocks, block_size, H_kv, D]` (H a multiple of H_kv); block_tables
    `[B, max_blocks]`; seq_lens `[B]` counts the new tokens too (already written with
    `write_kv`). `sliding_window` W lets a query at p see keys p-W+1..p. `max_query_len` /
    `max_seq_len` are optional host-side hints that spare the Triton path a device sync.
    Returns `[T, H, D]` in q's dtype.
    """
    _check_cache(k_cache, v_cache)
    _check_index("block_tables", block_tables, 2)
    _check_index("query_start_loc", query_start_loc, 1)
    _check_index("seq_lens", seq_lens, 1)
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3]:
        _fail(f"q must be [T, H, {k_cache.shape[3]}], got {tuple(q.shape)}")
    if q.shape[1] % k_cache.shape[2]:
        _fail(f"query heads {q.shape[1]} must be a multiple of KV heads {k_cache.shape[2]}")
    if (
        query_start_loc.shape[0] != seq_lens.shape[0] + 1
        or block_tables.shape[0] != seq_lens.shape[0]
    ):
        _fail(
            f"query_start_loc needs B+1 = {seq_lens.shape[0] + 1} entries and block_tables "
            f"B rows, got {query_start_loc.shape[0]} and {block_tables.shape[0]}"
        )
    if sliding_window is not None and sliding_window <= 0:
        _fail(f"sliding_window must be positive, got {sliding_window}")
    _check_same_device(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    if use_triton(q.device):
        from .paged_attention_kernel import paged_attention_triton

        return paged_attention_triton(
            q,
            k_cache,
            v_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            sliding_window,
            max_query_len,
            max_seq_len,
        )
    return paged_attention_cpu(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window
    )


# ----------------------------------------------------------------------------- Gated DeltaNet


def _check_activation(activation: Optional[str]) -> None:
    if activation not in (None, "silu", "swish"):
        _fail(f"unsupported activation {activation!r} (expected 'silu' or None)")


def _check_conv_weight(channels: int, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    if weight.dim() == 3 and weight.shape[1] == 1:
        _fail("weight must be [C, K]: pass conv1d.weight.squeeze(1)")
    if weight.dim() != 2 or weight.shape[0] != channels:
        _fail(f"weight must be [C={channels}, K], got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (channels,):
        _fail(f"bias must be [{channels}], got {tuple(bias.shape)}")


def _check_state_rows(
    name: str, state: torch.Tensor, batch: int, state_indices: Optional[torch.Tensor]
) -> None:
    if state_indices is None:
        if state.shape[0] != batch:
            _fail(f"{name} has {state.shape[0]} rows for a batch of {batch}")
    else:
        _check_index("state_indices", state_indices, 1)
        if state_indices.shape[0] != batch:
            _fail(f"state_indices has {state_indices.shape[0]} entries for a batch of {batch}")


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
    state_indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode step of the depthwise causal conv; shifts `conv_state` in place.

    x `[B, C]` (one token) or `[B, C, T]`; conv_state `[B, C, S]` with S >= K-1 (or a pool
    `[N, C, S]` addressed by `state_indices[B]`, -1 = padding row); weight `[C, K]`; bias
    `[C]` or None; activation "silu" or None. Returns x's shape and dtype.
    """
    _check_activation(activation)
    if x.dim() not in (2, 3):
        _fail(f"x must be [B, C] or [B, C, T], got {tuple(x.shape)}")
    _check_conv_weight(x.shape[1], weight, bias)
    if conv_state.dim() != 3 or conv_state.shape[1] != x.shape[1]:
        _fail(f"conv_state must be [B, C={x.shape[1]}, S], got {tuple(conv_state.shape)}")
    if conv_state.shape[2] < weight.shape[1] - 1:
        _fail(
            f"conv_state keeps {conv_state.shape[2]} inputs; kernel width {weight.shape[1]} "
            f"needs >= {weight.shape[1] - 1}"
        )
    _check_state_rows("conv_state", conv_state, x.shape[0], state_indices)
    _check_same_device(x, conv_state, weight, bias, state_indices)
    if use_triton(x.device):
        from .gated_delta import causal_conv1d_update_triton

        return causal_conv1d_update_triton(x, conv_state, weight, bias, activation, state_indices)
    return gdn.causal_conv1d_update_reference(
        x, conv_state, weight, bias, activation, state_indices
    )


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor],
    activation: Optional[str] = "silu",
    cu_seqlens: Optional[torch.Tensor] = None,
    state_len: Optional[int] = None,
):
    """Causal depthwise conv over prompt chunks; returns `(y, final_state)`.

    x `[B, C, T]`, or `[1, C, total]` with `cu_seqlens[N+1]`; initial_state `[N, C, S]` (the
    inputs just before each chunk) or None; final_state `[N, C, S]` (S from initial_state, else
    `state_len`, else K-1) to pass to `causal_conv1d_update`. Both devices run torch's conv
    here: it is a dense conv, not a gather.
    """
    _check_activation(activation)
    if x.dim() != 3:
        _fail(f"x must be [B, C, T], got {tuple(x.shape)}")
    _check_conv_weight(x.shape[1], weight, bias)
    num = x.shape[0]
    if cu_seqlens is not None:
        _check_index("cu_seqlens", cu_seqlens, 1)
        num = cu_seqlens.shape[0] - 1
    if initial_state is not None and (
        initial_state.dim() != 3 or initial_state.shape[:2] != (num, x.shape[1])
    ):
        _fail(
            f"initial_state must be [N={num}, C={x.shape[1]}, S], got {tuple(initial_state.shape)}"
        )
    _check_same_device(x, weight, bias, initial_state, cu_seqlens)
    return gdn.causal_conv1d_prefill_reference(
        x, weight, bias, initial_state, activation, cu_seqlens, state_len
    )


def _check_gdn(q, k, v, g, beta, leading: int) -> None:
    for name, t, dims in (("q", q, leading + 2), ("v", v, leading + 2), ("g", g, leading + 1)):
        if t.dim() != dims:
            _fail(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    gdn.check_gdn_shapes(q, k, v, g, beta)


def gated_delta_rule_decode(
    q,
    k,
    v,
    g,
    beta,
    state,
    use_qk_l2norm: bool = True,
    scale: Optional[float] = None,
    state_indices: Optional[torch.Tensor] = None,
):
    """One recurrent Gated DeltaNet step per request; returns `(o, new_state)`.

    q, k `[B, Hk, Dk]`; v `[B, Hv, Dv]`; g (log decay), beta `[B, Hv]`; state
    `[B, Hv, Dk, Dv]` (fp32 recommended), or a pool `[N, Hv, Dk, Dv]` addressed by
    `state_indices[B]` (-1 = padding row, output zeros). The state is updated IN PLACE and
    returned as `new_state`. A `[B, 1, H, D]` input (HF's layout) gives a `[B, 1, Hv, Dv]` o.
    """
    with_time = q.dim() == 4
    if with_time:
        if q.shape[1] != 1:
            _fail(f"decode takes one token per request, got q of shape {tuple(q.shape)}")
        q, k, v, g, beta = q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]
    _check_gdn(q, k, v, g, beta, leading=1)
    if state.dim() != 4 or state.shape[1:] != (v.shape[1], q.shape[2], v.shape[2]):
        _fail(
            f"state must be [B, Hv={v.shape[1]}, Dk={q.shape[2]}, Dv={v.shape[2]}], got "
            f"{tuple(state.shape)}"
        )
    _check_state_rows("state", state, q.shape[0], state_indices)
    _check_same_device(q, k, v, g, beta, state, state_indices)
    if use_triton(q.device):
        from .gated_delta import gated_delta_rule_decode_triton

        o, state = gated_delta_rule_decode_triton(
            q, k, v, g, beta, state, use_qk_l2norm, scale, state_indices
        )
    else:
        o, state = gdn.gated_delta_rule_decode_reference(
            q, k, v, g, beta, state, use_qk_l2norm, scale, state_indices
        )
    return (o[:, None] if with_time else o), state


def _fla_chunk_gated_delta_rule():
    """fla-core's chunked kernel when installed (the `cuda` extra), else None."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or broken against this torch/triton
        return None
    return chunk_gated_delta_rule


def gated_delta_rule_prefill(
    q,
    k,
    v,
    g,
    beta,
    initial_state: Optional[torch.Tensor] = None,
    use_qk_l2norm: bool = True,
    scale: Optional[float] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
):
    """Gated DeltaNet over prompt chunks; returns `(o, final_state)`.

    q, k `[B, T, Hk, Dk]`; v `[B, T, Hv, Dv]`; g, beta `[B, T, Hv]`; with `cu_seqlens[N+1]`
    B is 1 and N sequences lie back to back. initial_state `[N, Hv, Dk, Dv]` or None (zeros).
    o `[B, T, Hv, Dv]` in q's dtype; final_state `[N, Hv, Dk, Dv]` fp32. On CUDA this is
    fla-core's `chunk_gated_delta_rule` when installed, else the chunked torch algorithm.
    """
    _check_gdn(q, k, v, g, beta, leading=2)
    num = q.shape[0]
    if cu_seqlens is not None:
        _check_index("cu_seqlens", cu_seqlens, 1)
        if q.shape[0] != 1:
            _fail("with cu_seqlens, q/k/v must have batch size 1")
        num = cu_seqlens.shape[0] - 1
    expected = (num, v.shape[2], q.shape[3], v.shape[3])
    if initial_state is not None and tuple(initial_state.shape) != expected:
        _fail(f"initial_state must be {expected}, got {tuple(initial_state.shape)}")
    _check_same_device(q, k, v, g, beta, initial_state, cu_seqlens)
    if use_triton(q.device):
        chunk = _fla_chunk_gated_delta_rule()
        if chunk is not None:
            o, final = chunk(
                q,
                k,
                v,
                g.float(),
                beta,
                scale=scale,
                initial_state=None if initial_state is None else initial_state.float(),
                output_final_state=True,
                use_qk_l2norm_in_kernel=use_qk_l2norm,
                cu_seqlens=None if cu_seqlens is None else cu_seqlens.long(),
            )
            return o, final.float()
    return gdn.gated_delta_rule_chunked_reference(
        q, k, v, g, beta, initial_state, use_qk_l2norm, scale, cu_seqlens
    )
