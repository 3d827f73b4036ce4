"""pdpool.kernels: Triton kernels for the engine's CUDA path, each with its torch reference.

The engine uses the API of `ops` (re-exported here); it picks Triton on CUDA and the torch
references elsewhere, and `PDPOOL_FORCE_TORCH=1` forces the torch path on CUDA.
"""

from .ops import (
    causal_conv1d_prefill,
    causal_conv1d_update,
    gated_delta_rule_decode,
    gated_delta_rule_prefill,
    paged_attention,
    use_triton,
    write_kv,
)

__all__ = [
    "causal_conv1d_prefill",
    "causal_conv1d_update",
    "gated_delta_rule_decode",
    "gated_delta_rule_prefill",
    "paged_attention",
    "use_triton",
    "write_kv",
]
