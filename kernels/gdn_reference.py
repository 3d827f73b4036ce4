"""Torch references for Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention); also the CPU path.

Semantics follow Hugging Face transformers' `torch_causal_conv1d_update`, `causal_conv1d_fn`,
`torch_recurrent_gated_delta_rule` and `torch_chunk_gated_delta_rule` (qwen3_5 / qwen3_next):

- q/k are L2-normalised in fp32 (eps 1e-6, `x * rsqrt(sum(x^2) + eps)`) when asked, then q is
  multiplied by `scale` (default `k_head_dim ** -0.5`).
- `g` is the log decay (<= 0): each step the state is multiplied by `exp(g)`, then the delta
  rule writes `beta * (v - S^T k)` along `k`, and the output reads `S^T q`.
- Grouped value heads: q/k have `Hk` heads, v/g/beta have `Hv` (a multiple of Hk); value head h
  uses q/k head `h // (Hv // Hk)` (HF's `repeat_interleave`).
- The recurrent state is `[.., Hv, Dk, Dv]` and kept in fp32 by the callers.

Conv state: `conv_state[N, C, S]` holds the last S inputs of a sequence (S >= kernel - 1; HF
keeps S = kernel). `state_indices` (optional, int `[B]`) lets a decode step read and write rows
of a state pool in place; an index of -1 marks a padding row that is skipped (output zeros).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


def _activate(x: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"unsupported activation {activation!r} (expected 'silu' or None)")


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """`x * rsqrt(sum(x^2) + eps)` over the last dim (the FLA / HF convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- causal conv1d


def causal_conv1d_update_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: Optional[str] = "silu",
    state_indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One or a few decode tokens of a depthwise causal conv; updates `conv_state` in place.

    x: `[B, C]` or `[B, C, T]`; conv_state: `[B, C, S]` (or a pool `[N, C, S]` with
    `state_indices[B]`); weight `[C, K]`; bias `[C]` or None. Returns x's shape and dtype.
    """
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    width = weight.shape[-1]
    if state_indices is None:
        rows = None
        state = conv_state
    else:
        rows = state_indices.long()
        live = rows >= 0
        state = torch.zeros(
            xs.shape[0],
            conv_state.shape[1],
            conv_state.shape[2],
            dtype=conv_state.dtype,
            device=conv_state.device,
        )
        state[live] = conv_state[rows[live]]
    state_len = state.shape[-1]
    if state_len < width - 1:
        raise ValueError(
            f"conv_state keeps {state_len} inputs; kernel width {width} needs >= {width - 1}"
        )
    full = torch.cat([state.float(), xs.float()], dim=-1)  # [B, C, S + T]
    window = full[..., state_len + 1 - width :]  # the inputs the T outputs need
    out = F.conv1d(
        window,
        weight.float().unsqueeze(1),
        None if bias is None else bias.float(),
        groups=xs.shape[1],
    )
    out = _activate(out, activation)
    new_state = full[..., -state_len:].to(conv_state.dtype)
    if rows is None:
        conv_state.copy_(new_state)
    else:
        conv_state[rows[live]] = new_state[live]
        out[~live] = 0
    out = out.to(x.dtype)
    return out.squeeze(-1) if squeeze else out


def causal_conv1d_prefill_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor],
    activation: Optional[str] = "silu",
    cu_seqlens: Optional[torch.Tensor] = None,
    state_len: Optional[int] = None,
):
    """Causal depthwise conv over whole prompt chunks.

    x: `[B, C, T]`, or `[1, C, total]` holding N sequences back to back with `cu_seqlens[N+1]`.
    initial_state: `[N, C, S]` (the inputs before each chunk) or None (zeros).
    Returns `(y, final_state)`: y like x; final_state `[N, C, S]` in initial_state's dtype (x's
    when None) holding the last S inputs, S = initial_state's width, else `state_len`, else K-1.
    """
    width = weight.shape[-1]
    if cu_seqlens is None:
        bounds = None
        num = x.shape[0]
    else:
        if x.shape[0] != 1:
            raise ValueError("with cu_seqlens, x must be [1, C, total_tokens]")
        bounds = cu_seqlens.tolist()
        num = len(bounds) - 1
    if initial_state is not None:
        state_len = initial_state.shape[-1]
        state_dtype = initial_state.dtype
    else:
        state_len = width - 1 if state_len is None else state_len
        state_dtype = x.dtype
    channels = x.shape[1]
    y = torch.empty_like(x)
    final = torch.empty(num, channels, state_len, dtype=state_dtype, device=x.device)
    w = weight.float().unsqueeze(1)
    b = None if bias is None else bias.float()
    for n in range(num):
        seq = x[n] if bounds is None else x[0, :, bounds[n] : bounds[n + 1]]
        prev = (
            torch.zeros(channels, state_len, device=x.device)
            if initial_state is None
            else initial_state[n].float()
        )
        full = torch.cat([prev, seq.float()], dim=-1)  # [C, S + T]
        if state_len < width - 1:  # too short a state: zero history
            full = F.pad(full, (width - 1 - state_len, 0))
        window = full[:, full.shape[-1] - seq.shape[-1] - (width - 1) :]
        out = _activate(F.conv1d(window.unsqueeze(0), w, b, groups=channels)[0], activation)
        if bounds is None:
            y[n] = out.to(x.dtype)
        else:
            y[0, :, bounds[n] : bounds[n + 1]] = out.to(x.dtype)
        final[n] = full[:, -state_len:].to(state_dtype) if state_len else full[:, :0]
    return y, final


# ----------------------------------------------------------------------------- gated delta rule


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool, scale: Optional[float]
):
    """fp32 q/k expanded to the value heads, normalised and scaled like HF."""
    ratio = num_v_heads // q.shape[-2]
    q, k = q.float(), k.float()
    if ratio > 1:
        q = q.repeat_interleave(ratio, dim=-2)
        k = k.repeat_interleave(ratio, dim=-2)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k


def check_gdn_shapes(q, k, v, g, beta) -> None:
    """Raises ValueError unless q/k `[.., Hk, Dk]`, v `[.., Hv, Dv]`, g/beta `[.., Hv]` agree."""
    if q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape")
    if v.shape[:-2] != q.shape[:-2]:
        raise ValueError(f"v {tuple(v.shape)} does not match q {tuple(q.shape)} on leading dims")
    if v.shape[-2] % q.shape[-2]:
        raise ValueError(f"value heads {v.shape[-2]} must be a multiple of key heads {q.shape[-2]}")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != v.shape[:-1]:
            raise ValueError(f"{name} {tuple(t.shape)} must be {tuple(v.shape[:-1])}")


def gated_delta_rule_recurrent_reference(
    q, k, v, g, beta, initial_state=None, use_qk_l2norm: bool = True, scale: Optional[float] = None
):
    """Token-by-token gated delta rule; the ground truth.

    q, k: `[B, T, Hk, Dk]`; v: `[B, T, Hv, Dv]`; g, beta: `[B, T, Hv]`;
    initial_state `[B, Hv, Dk, Dv]` or None. Returns `(o [B, T, Hv, Dv] in q's dtype,
    final_state [B, Hv, Dk, Dv] fp32)`.
    """
    check_gdn_shapes(q, k, v, g, beta)
    batch, seq_len, num_v_heads, dv = v.shape
    qf, kf = _prepare_qk(q, k, num_v_heads, use_qk_l2norm, scale)
    vf, gf, bf = v.float(), g.float(), beta.float()
    state = (
        torch.zeros(batch, num_v_heads, qf.shape[-1], dv, device=v.device)
        if initial_state is None
        else initial_state.float().clone()
    )
    out = torch.empty(batch, seq_len, num_v_heads, dv, device=v.device)
    for t in range(seq_len):
        state = state * gf[:, t].exp()[..., None, None]
        kv_mem = torch.einsum("bhkv,bhk->bhv", state, kf[:, t])
        delta = (vf[:, t] - kv_mem) * bf[:, t, :, None]
        state = state + kf[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, qf[:, t])
    return out.to(q.dtype), state


def gated_delta_rule_decode_reference(
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
    """One decode token per request; updates `state` in place and returns `(o, state)`.

    q, k: `[B, Hk, Dk]`; v: `[B, Hv, Dv]`; g, beta: `[B, Hv]`; state `[B, Hv, Dk, Dv]`, or a
    pool `[N, Hv, Dk, Dv]` addressed by `state_indices[B]` (-1 = padding row, output zeros).
    """
    check_gdn_shapes(q, k, v, g, beta)
    if state_indices is None:
        rows, live = None, None
        current = state.float()
    else:
        rows = state_indices.long()
        live = rows >= 0
        current = torch.zeros(v.shape[0], *state.shape[1:], device=state.device)
        current[live] = state[rows[live]].float()
    o, new_state = gated_delta_rule_recurrent_reference(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], current, use_qk_l2norm, scale
    )
    o = o[:, 0]
    if rows is None:
        state.copy_(new_state.to(state.dtype))
    else:
        state[rows[live]] = new_state[live].to(state.dtype)
        o[~live] = 0
    return o, state


def _chunked_one(q, k, v, g, beta, state, chunk_size: int):
    """Chunked gated delta rule for one sequence, all fp32 and already prepared.

    q, k: `[H, T, Dk]` (scaled / normalised); v `[H, T, Dv]`; g, beta `[H, T]`;
    state `[H, Dk, Dv]`. Within a chunk the delta-rule updates collapse to a unit lower
    triangular solve (the WY / UT representation), so the sequential part is per chunk only.
    """
    heads, seq_len, _ = k.shape
    out = torch.empty(heads, seq_len, v.shape[-1], device=v.device)
    for lo in range(0, seq_len, chunk_size):
        hi = min(lo + chunk_size, seq_len)
        qc, kc, vc, bc = q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], beta[:, lo:hi]
        cum = g[:, lo:hi].cumsum(-1)  # log decay from chunk start
        n = hi - lo
        causal = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()
        # decay[i, j] = exp(cum_i - cum_j) for j <= i
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        strict = torch.eye(n, dtype=torch.bool, device=v.device).logical_not() & causal
        kk = (kc @ kc.transpose(-1, -2)) * decay * bc[:, :, None]
        system = torch.eye(n, device=v.device) + kk.masked_fill(~strict, 0.0)
        # u = T^-1 (beta v), w = T^-1 (beta exp(cum) k): corrected values, decayed keys
        u = torch.linalg.solve_triangular(
            system, vc * bc[..., None], upper=False, unitriangular=True
        )
        w = torch.linalg.solve_triangular(
            system, kc * (bc * cum.exp())[..., None], upper=False, unitriangular=True
        )
        v_new = u - w @ state  # [H, n, Dv]
        attn = (qc @ kc.transpose(-1, -2)) * decay  # intra-chunk, causal
        out[:, lo:hi] = (qc * cum.exp()[..., None]) @ state + attn @ v_new
        last = cum[:, -1:]
        state = (
            state * last.exp()[..., None]
            + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ v_new
        )
    return out, state


def gated_delta_rule_chunked_reference(
    q,
    k,
    v,
    g,
    beta,
    initial_state=None,
    use_qk_l2norm: bool = True,
    scale: Optional[float] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
):
    """Prefill with the chunked algorithm (same result as the recurrent one, much faster).

    q, k: `[B, T, Hk, Dk]`; v: `[B, T, Hv, Dv]`; g, beta: `[B, T, Hv]`. With `cu_seqlens[N+1]`,
    B must be 1 and the N sequences lie back to back. initial_state `[N, Hv, Dk, Dv]` or None.
    Returns `(o [B, T, Hv, Dv] in q's dtype, final_state [N, Hv, Dk, Dv] fp32)`.
    """
    check_gdn_shapes(q, k, v, g, beta)
    num_v_heads, dk, dv = v.shape[-2], q.shape[-1], v.shape[-1]
    if cu_seqlens is None:
        spans = [(b, 0, q.shape[1]) for b in range(q.shape[0])]
    else:
        if q.shape[0] != 1:
            raise ValueError("with cu_seqlens, q/k/v must have batch size 1")
        bounds = cu_seqlens.tolist()
        spans = [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]
    if initial_state is not None and initial_state.shape[0] != len(spans):
        raise ValueError(
            f"initial_state has {initial_state.shape[0]} rows for {len(spans)} sequences"
        )
    qf, kf = _prepare_qk(q, k, num_v_heads, use_qk_l2norm, scale)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    final = torch.empty(len(spans), num_v_heads, dk, dv, device=v.device)
    for n, (b, lo, hi) in enumerate(spans):
        state = (
            torch.zeros(num_v_heads, dk, dv, device=v.device)
            if initial_state is None
            else initial_state[n].float()
        )
        if hi > lo:
            o, state = _chunked_one(
                qf[b, lo:hi].transpose(0, 1),
                kf[b, lo:hi].transpose(0, 1),
                v[b, lo:hi].float().transpose(0, 1),
                g[b, lo:hi].float().transpose(0, 1),
                beta[b, lo:hi].float().transpose(0, 1),
                state,
                chunk_size,
            )
            out[b, lo:hi] = o.transpose(0, 1)
        final[n] = state
    return out.to(q.dtype), final
