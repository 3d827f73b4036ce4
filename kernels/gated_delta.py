"""Triton kernels for the Gated DeltaNet decode step (Qwen3.5 linear-attention layers).

- `causal_conv1d_update_triton`: the depthwise causal conv over `[conv_state, x]` for a few
  new tokens per request, with the conv state shifted in place.
- `gated_delta_rule_decode_triton`: one recurrent step per request; a program owns one value
  head and a slice of the value dim, holds its `[Dk, BLOCK_V]` state tile in registers, and
  reads / writes the state once (decode is bound by that state traffic).

Both take an optional `state_indices[B]` to address rows of a state pool in place (-1 = padding
row: skipped, output zeros). Semantics and shapes: `gdn_reference.py`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .gdn_reference import L2NORM_EPS


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def _conv1d_update_kernel(
    x_ptr,
    state_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    indices_ptr,
    channels,
    seq_len,
    stride_xb,
    stride_xc,
    stride_xt,
    stride_sb,
    stride_sc,
    stride_ss,
    stride_wc,
    stride_wk,
    stride_ob,
    stride_oc,
    stride_ot,
    STATE_LEN: tl.constexpr,
    WIDTH: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    HAS_INDICES: tl.constexpr,
):
    batch = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_ok = chans < channels
    x_row = x_ptr + batch.to(tl.int64) * stride_xb + chans * stride_xc
    o_row = out_ptr + batch.to(tl.int64) * stride_ob + chans * stride_oc
    # HAS_INDICES is a constexpr: the kernel is compiled with one branch or the other.
    slot = tl.load(indices_ptr + batch).to(tl.int64) if HAS_INDICES else batch.to(tl.int64)
    if slot < 0:  # padding row
        for t in range(seq_len):
            tl.store(
                o_row + t * stride_ot,
                tl.zeros([BLOCK_C], dtype=tl.float32).to(out_ptr.dtype.element_ty),
                mask=chan_ok,
            )
        return
    s_row = state_ptr + slot * stride_sb + chans * stride_sc

    # Sequence z = [state (STATE_LEN), x (seq_len)]; output t reads z[STATE_LEN+t-WIDTH+1 ..].
    for t in range(seq_len):
        if HAS_BIAS:
            acc = tl.load(bias_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for i in tl.static_range(WIDTH):
            # a vector position keeps the masks tensors (the interpreter rejects scalar masks)
            pos = STATE_LEN + t - (WIDTH - 1) + i + tl.zeros([BLOCK_C], dtype=tl.int32)
            from_state = pos < STATE_LEN
            old = tl.load(s_row + pos * stride_ss, mask=chan_ok & from_state, other=0.0)
            new = tl.load(
                x_row + (pos - STATE_LEN) * stride_xt, mask=chan_ok & (pos >= STATE_LEN), other=0.0
            )
            value = tl.where(from_state, old.to(tl.float32), new.to(tl.float32))
            w = tl.load(weight_ptr + chans * stride_wc + i * stride_wk, mask=chan_ok, other=0.0)
            acc += w.to(tl.float32) * value
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(o_row + t * stride_ot, acc.to(out_ptr.dtype.element_ty), mask=chan_ok)

    # New state: the last STATE_LEN entries of z (all loads happen before the stores).
    cols = tl.arange(0, S_PAD)
    src = cols + seq_len
    col_ok = chan_ok[:, None] & (cols < STATE_LEN)[None, :]
    from_state = (src < STATE_LEN)[None, :]
    old = tl.load(s_row[:, None] + src[None, :] * stride_ss, mask=col_ok & from_state, other=0.0)
    new = tl.load(
        x_row[:, None] + (src - STATE_LEN)[None, :] * stride_xt,
        mask=col_ok & (src >= STATE_LEN)[None, :],
        other=0.0,
    )
    shifted = tl.where(from_state, old.to(tl.float32), new.to(tl.float32))
    tl.store(
        s_row[:, None] + cols[None, :] * stride_ss,
        shifted.to(state_ptr.dtype.element_ty),
        mask=col_ok,
    )


CONV_BLOCK_C = 128


def conv_update_constexprs(
    state_len: int, width: int, has_bias: bool, silu: bool, has_indices: bool
) -> dict:
    return dict(
        STATE_LEN=state_len,
        WIDTH=width,
        S_PAD=_next_pow2(max(state_len, 1)),
        BLOCK_C=CONV_BLOCK_C,
        HAS_BIAS=has_bias,
        SILU=silu,
        HAS_INDICES=has_indices,
    )


def causal_conv1d_update_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: Optional[str] = "silu",
    state_indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton version of `causal_conv1d_update_reference` (same arguments and result)."""
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    batch, channels, seq_len = xs.shape
    out = torch.empty_like(xs)
    if batch == 0 or seq_len == 0:
        return out.squeeze(-1) if squeeze else out
    state_len, width = conv_state.shape[-1], weight.shape[-1]
    _conv1d_update_kernel[(batch, triton.cdiv(channels, CONV_BLOCK_C))](
        xs,
        conv_state,
        weight,
        weight if bias is None else bias,
        out,
        xs if state_indices is None else state_indices,
        channels,
        seq_len,
        xs.stride(0),
        xs.stride(1),
        xs.stride(2),
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        **conv_update_constexprs(
            state_len, width, bias is not None, activation is not None, state_indices is not None
        ),
    )
    return out.squeeze(-1) if squeeze else out


@triton.jit
def _gated_delta_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    out_ptr,
    indices_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_gb,
    stride_betab,
    stride_sn,
    stride_sh,
    stride_sk,
    stride_sv,
    stride_ob,
    stride_oh,
    V_PER_K: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    DK_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr,
    EPS: tl.constexpr,
    HAS_INDICES: tl.constexpr,
):
    batch = tl.program_id(0).to(tl.int64)
    v_head = tl.program_id(1)
    vdims = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vdims < DV
    o_row = out_ptr + batch * stride_ob + v_head * stride_oh + vdims
    slot = tl.load(indices_ptr + batch).to(tl.int64) if HAS_INDICES else batch  # constexpr
    if slot < 0:  # padding row
        tl.store(
            o_row, tl.zeros([BLOCK_V], dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=v_ok
        )
        return
    k_head = v_head // V_PER_K
    kdims = tl.arange(0, DK_PAD)
    k_ok = kdims < DK
    q = tl.load(q_ptr + batch * stride_qb + k_head * stride_qh + kdims, mask=k_ok, other=0.0).to(
        tl.float32
    )
    k = tl.load(k_ptr + batch * stride_kb + k_head * stride_kh + kdims, mask=k_ok, other=0.0).to(
        tl.float32
    )
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, 0) + EPS)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + EPS)
    q = q * scale
    v = tl.load(v_ptr + batch * stride_vb + v_head * stride_vh + vdims, mask=v_ok, other=0.0).to(
        tl.float32
    )
    decay = tl.exp(tl.load(g_ptr + batch * stride_gb + v_head).to(tl.float32))
    beta = tl.load(beta_ptr + batch * stride_betab + v_head).to(tl.float32)

    s_ptrs = (
        state_ptr
        + slot * stride_sn
        + v_head * stride_sh
        + kdims[:, None] * stride_sk
        + vdims[None, :] * stride_sv
    )
    s_mask = k_ok[:, None] & v_ok[None, :]
    state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32) * decay  # [DK, BLOCK_V]
    predicted = tl.sum(state * k[:, None], 0)  # S^T k
    delta = (v - predicted) * beta
    state = state + k[:, None] * delta[None, :]
    out = tl.sum(state * q[:, None], 0)
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=s_mask)
    tl.store(o_row, out.to(out_ptr.dtype.element_ty), mask=v_ok)


def gdn_decode_constexprs(
    num_k_heads: int, num_v_heads: int, dk: int, dv: int, use_qk_l2norm: bool, has_indices: bool
) -> dict:
    return dict(
        V_PER_K=num_v_heads // num_k_heads,
        DK=dk,
        DV=dv,
        DK_PAD=_next_pow2(dk),
        BLOCK_V=min(_next_pow2(dv), 32 if dk > 128 else 64),
        L2NORM=bool(use_qk_l2norm),
        EPS=L2NORM_EPS,
        HAS_INDICES=has_indices,
    )


def gated_delta_rule_decode_triton(
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
    """Triton version of `gated_delta_rule_decode_reference` (in place; returns (o, state))."""
    batch, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    out = torch.empty(batch, num_v_heads, dv, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out, state
    # Contiguous head dims let the kernel use unit strides along Dk / Dv.
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    constexprs = gdn_decode_constexprs(
        num_k_heads, num_v_heads, dk, dv, use_qk_l2norm, state_indices is not None
    )
    grid = (batch, num_v_heads, triton.cdiv(dv, constexprs["BLOCK_V"]))
    _gated_delta_decode_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        state,
        out,
        q if state_indices is None else state_indices,
        dk**-0.5 if scale is None else float(scale),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        state.stride(0),
        state.stride(1),
        state.stride(2),
        state.stride(3),
        out.stride(0),
        out.stride(1),
        **constexprs,
        num_warps=4,
    )
    return out, state
