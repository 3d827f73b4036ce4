"""Triton LoRA for a batch mixing adapters: each token gathers its own slot's A and B
(the BGMV shape of punica/vLLM's kernels), so one launch serves every adapter in the step.

shrink: h[t, :R] = x[t] @ A_s.T          one program per token, K in BLOCK_K chunks
expand: y[t, n] += h[t] @ B_s[n].T       one program per (token, BLOCK_N outputs)
Tokens of slot -1 are skipped. Layouts as kernels/lora_reference.py: `a` is [S*R, in],
`b` is [out, S*R]; h is float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, h_ptr, slots_ptr,
    K, R,
    stride_xt, stride_xk, stride_ar, stride_ak, stride_ht,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    s = tl.load(slots_ptr + t)
    if s >= 0:
        r = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + t * stride_xt + k * stride_xk, mask=k < K, other=0.0)
            av = tl.load(
                a_ptr + (s * R + r[:, None]) * stride_ar + k[None, :] * stride_ak,
                mask=(r[:, None] < R) & (k[None, :] < K),
                other=0.0,
            )
            acc += tl.sum(av.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
        tl.store(h_ptr + t * stride_ht + r, acc, mask=r < R)


@triton.jit
def _lora_expand_kernel(
    h_ptr, b_ptr, y_ptr, slots_ptr,
    N, R,
    stride_ht, stride_bn, stride_br, stride_yt, stride_yn,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    s = tl.load(slots_ptr + t)
    if s >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        hv = tl.load(h_ptr + t * stride_ht + r, mask=r < R, other=0.0)
        bv = tl.load(
            b_ptr + n[:, None] * stride_bn + (s * R + r[None, :]) * stride_br,
            mask=(n[:, None] < N) & (r[None, :] < R),
            other=0.0,
        )
        delta = tl.sum(bv.to(tl.float32) * hv[None, :], axis=1)
        y_ptrs = y_ptr + t * stride_yt + n * stride_yn
        yv = tl.load(y_ptrs, mask=n < N, other=0.0)
        tl.store(y_ptrs, (yv.to(tl.float32) + delta).to(yv.dtype), mask=n < N)


def lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    rank: int,
) -> torch.Tensor:
    """Adds each token's own adapter's LoRA output into `y` [T, out]; returns `y`."""
    num_tokens, k = x.shape
    n = y.shape[1]
    h = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    block_r = max(triton.next_power_of_2(rank), 16)
    _lora_shrink_kernel[(num_tokens,)](
        x, a, h, token_slots, k, rank,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), h.stride(0),
        BLOCK_R=block_r, BLOCK_K=64,
    )  # fmt: skip
    block_n = 64
    _lora_expand_kernel[(num_tokens, triton.cdiv(n, block_n))](
        h, b, y, token_slots, n, rank,
        h.stride(0), b.stride(0), b.stride(1), y.stride(0), y.stride(1),
        BLOCK_R=block_r, BLOCK_N=block_n,
    )  # fmt: skip
    return y
