"""The Qwen3.5 side of `pdpool tiny-model --arch qwen3_5`: a dense, text-only hybrid config.

Layer kinds follow the real checkpoints: three Gated DeltaNet (`linear_attention`) layers,
then one gated `full_attention` layer, repeated; the last layer is always full attention so
that even a 2-layer model has a KV cache. The linear-attention heads are shaped to
catch layout mix-ups: value heads are twice the key heads (real Qwen3.5 uses 16 key / 32
value heads of 128). Key and value head dims are equal (`linear_head_dim`, 64), as in the
real checkpoints: vLLM's CPU Gated DeltaNet kernel needs that, rejects 32 ("Unexpected head
dim size") and runs in bfloat16 only, so the same tiny checkpoint (with --dtype bfloat16)
runs on both engines.
"""

from __future__ import annotations

FULL_ATTENTION_INTERVAL = 4
CONV_KERNEL = 4
PARTIAL_ROTARY_FACTOR = 0.25


def hybrid_layer_types(num_layers: int) -> list[str]:
    """`linear_attention` x3 then `full_attention`, repeated; the last layer is full."""
    return [
        "full_attention"
        if (i + 1) % FULL_ATTENTION_INTERVAL == 0 or i == num_layers - 1
        else "linear_attention"
        for i in range(num_layers)
    ]


def validate_qwen3_5_spec(spec) -> None:
    """Raises ValueError for a `TinyModelSpec` that cannot make a sound Qwen3.5 model."""
    if spec.sliding_window:
        raise ValueError("--sliding-window applies to --arch qwen3 only")
    if spec.num_layers < 2:
        raise ValueError("--arch qwen3_5 needs --layers >= 2 (Gated DeltaNet and full attention)")
    rotary_dim = int(spec.head_dim * PARTIAL_ROTARY_FACTOR)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(
            f"--head-dim {spec.head_dim} leaves an odd or empty rotary part "
            f"({PARTIAL_ROTARY_FACTOR} of it); use a multiple of 8"
        )


def qwen3_5_config(spec, tokenizer):
    """A `Qwen3_5TextConfig` (architecture `Qwen3_5ForCausalLM`) from a `TinyModelSpec`."""
    from transformers import Qwen3_5TextConfig

    validate_qwen3_5_spec(spec)
    config = Qwen3_5TextConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": PARTIAL_ROTARY_FACTOR,
        },
        layer_types=hybrid_layer_types(spec.num_layers),
        linear_num_key_heads=spec.num_kv_heads,
        linear_num_value_heads=spec.num_heads,
        linear_key_head_dim=spec.linear_head_dim,
        linear_value_head_dim=spec.linear_head_dim,
        linear_conv_kernel_dim=CONV_KERNEL,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=spec.dtype,
    )
    config.architectures = ["Qwen3_5ForCausalLM"]
    return config


def randomize_qwen3_5_vectors(model, seed: int) -> None:
    """Gives the 1-D parameters random but sane values, so parity tests exercise them.

    Zero-centred norms (stored as weight - 1) get small offsets and the gated norms a spread
    around 1: a wrong norm formula then changes the logits. A_log and dt_bias are drawn for a
    long memory (per-token decay exp(-A * softplus(a + dt_bias)) mostly in 0.7..1): HF's
    init (A up to 16) forgets within a token or two and would hide a state that is not
    carried across prefill chunks or decode steps.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() != 1:
                continue
            shape = param.shape
            if name.endswith("A_log"):
                a = torch.empty(shape).uniform_(0.002, 0.25, generator=gen)
                param.copy_(a.log())
            elif name.endswith("dt_bias"):
                param.copy_(torch.empty(shape).uniform_(-1.0, 1.0, generator=gen))
            elif name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(shape, generator=gen))
            elif name.endswith("norm.weight"):
                param.copy_(0.2 * torch.randn(shape, generator=gen))
