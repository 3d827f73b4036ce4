"""Qwen3.5 dense text model (`Qwen3_5ForCausalLM`), parameter names as in the HF checkpoint.

A hybrid of two layer kinds, picked per layer by `layer_types`:
- `full_attention`: gated attention. q_proj yields each head's query and an output gate;
  q/k get zero-centred RMSNorm, rotary covers only `partial_rotary_factor` of the head dim,
  and the attention output is multiplied by sigmoid(gate). K/V live in the paged cache;
  full-attention layer j uses `kv_cache[:, j]`.
- `linear_attention`: Gated DeltaNet. A causal depthwise conv over q/k/v, then the gated
  delta rule with a recurrent state, then a gated RMSNorm. Each running request owns a
  state slot (`meta.state_slots`) holding, per linear layer, the conv state (the last K-1
  conv inputs) and the SSM state `[Hv, Dk, Dv]` (fp32), both read and written in place.

Within one step, sequences that decode one token from a held state take the decode ops
(in place, by slot); every other sequence (a prompt chunk, or a first token) is packed into
one varlen prefill that starts from its slot's state (or zeros) and writes the final state
back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from pdpool.engine.attention_metadata import AttentionMetadata
from pdpool.engine.models.base import PagedCausalLM, head_dim_of
from pdpool.engine.models.layers import GatedMLP, PagedAttention, RMSNorm
from pdpool.kernels import ops

LINEAR = "linear_attention"
FULL = "full_attention"


def partial_rotary_factor_of(config: dict) -> float:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))


def hybrid_layer_types_of(config: dict) -> list[str]:
    n = config["num_hidden_layers"]
    types = config.get("layer_types")
    if not types:  # HF's default: every `full_attention_interval`-th layer is full attention
        interval = config.get("full_attention_interval", 4)
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    unknown = sorted(set(types) - {LINEAR, FULL})
    if len(types) != n or unknown:
        raise ValueError(f"layer_types must list {n} layers of {LINEAR!r} / {FULL!r}, got {types}")
    return list(types)


# ----------------------------------------------------------------------------- state


@dataclass
class RecurrentState:
    """The per-slot states of every linear-attention layer.

    conv `[num_slots, L_lin, conv_dim, K-1]` (model dtype): the last K-1 conv inputs.
    ssm `[num_slots, L_lin, Hv, Dk, Dv]` (fp32): the gated delta rule's state.
    A slot's whole state is `conv[slot]` and `ssm[slot]`.
    """

    conv: torch.Tensor
    ssm: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.conv.shape[0]


@dataclass
class RecurrentBatch:
    """How a step's sequences split between the decode and the prefill paths.

    Built once per forward from the metadata and shared by every linear layer. Token rows
    index the flat batch; `None` rows mean "all tokens, in order" (no gather needed).
    """

    decode_rows: Optional[torch.Tensor]  # [Bd] token rows of one-token decodes
    decode_slots: Optional[torch.Tensor]  # [Bd] their state slots
    prefill_rows: Optional[torch.Tensor]  # [Tp] token rows of the prefill sequences
    prefill_slots: Optional[torch.Tensor]  # [Np]
    prefill_fresh: Optional[torch.Tensor]  # [Np] bool, True: start from a zero state
    cu_seqlens: Optional[torch.Tensor]  # [Np+1] int32 over the packed prefill tokens
    num_tokens: int

    @staticmethod
    def plan(meta: AttentionMetadata, num_tokens: int, device) -> "RecurrentBatch":
        if meta.state_slots is None or meta.state_has_initial is None:
            raise ValueError("a Qwen3.5 batch needs state_slots and state_has_initial")
        decode_seqs, prefill_seqs, starts = [], [], [0]
        for b, (n, has_initial) in enumerate(
            zip(meta.query_lens, meta.state_has_initial, strict=True)
        ):
            (decode_seqs if n == 1 and has_initial else prefill_seqs).append(b)
            starts.append(starts[-1] + n)
        if starts[-1] != num_tokens:
            raise ValueError(f"query_lens cover {starts[-1]} tokens, the batch has {num_tokens}")

        def index(values):
            return torch.tensor(values, dtype=torch.int64, device=device)

        slots = meta.state_slots
        decode_rows = decode_slots = prefill_rows = prefill_slots = None
        prefill_fresh = cu_seqlens = None
        if decode_seqs:
            decode_rows = index([starts[b] for b in decode_seqs])
            decode_slots = slots[index(decode_seqs)]
        if prefill_seqs:
            if len(prefill_seqs) < len(meta.query_lens):
                prefill_rows = index(
                    [t for b in prefill_seqs for t in range(starts[b], starts[b + 1])]
                )
            prefill_slots = slots[index(prefill_seqs)]
            prefill_fresh = torch.tensor(
                [not meta.state_has_initial[b] for b in prefill_seqs],
                dtype=torch.bool,
                device=device,
            )
            cu = [0]
            for b in prefill_seqs:
                cu.append(cu[-1] + meta.query_lens[b])
            cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
        return RecurrentBatch(
            decode_rows,
            decode_slots,
            prefill_rows,
            prefill_slots,
            prefill_fresh,
            cu_seqlens,
            num_tokens,
        )


# ----------------------------------------------------------------------------- layers


class RMSNormGated(nn.Module):
    """HF's `Qwen3_5RMSNormGated`: RMSNorm (weight around 1), then times silu(gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class Qwen3_5GatedAttention(nn.Module):
    """Full attention with an output gate, q/k norms and partial rotary."""

    def __init__(self, config: dict, attention_index: int):
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config["num_key_value_heads"]
        self.head_dim = head_dim_of(config)
        bias = config.get("attention_bias", False)
        eps = config.get("rms_norm_eps", 1e-6)
        # Each head's q_proj rows are [query | gate].
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps, zero_centered=True)
        self.k_norm = RMSNorm(self.head_dim, eps, zero_centered=True)
        self.attn = PagedAttention(
            attention_index, self.num_heads, self.num_kv_heads, self.head_dim
        )

    def forward(self, x, positions, rotary, kv_cache, meta):
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary.norm_and_rotate(positions, q, k, self.q_norm, self.k_norm)
        o = self.attn(q, k, v, kv_cache, meta).reshape(t, -1)
        return self.o_proj(o * torch.sigmoid(gate.reshape(t, -1)))


class Qwen3_5GatedDeltaNet(nn.Module):
    """Linear attention with a recurrent state (HF's `Qwen3_5GatedDeltaNet`)."""

    def __init__(self, config: dict, linear_index: int):
        super().__init__()
        hidden = config["hidden_size"]
        self.linear_index = linear_index  # index among the model's linear-attention layers
        self.num_k_heads = config["linear_num_key_heads"]
        self.num_v_heads = config["linear_num_value_heads"]
        self.head_k_dim = config["linear_key_head_dim"]
        self.head_v_dim = config["linear_value_head_dim"]
        if self.num_v_heads % self.num_k_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = config.get("linear_conv_kernel_dim", 4)
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"Gated DeltaNet supports the silu activation, not {act!r}")
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            self.conv_kernel,
            bias=False,
            groups=self.conv_dim,
            padding=self.conv_kernel - 1,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = RMSNormGated(self.head_v_dim, config.get("rms_norm_eps", 1e-6))
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-slot (conv, ssm) state shapes of this layer."""
        return (
            (self.conv_dim, self.conv_kernel - 1),
            (self.num_v_heads, self.head_k_dim, self.head_v_dim),
        )

    def _split_qkv(self, mixed: torch.Tensor):
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        t = mixed.shape[0]
        return (
            q.reshape(t, self.num_k_heads, self.head_k_dim),
            k.reshape(t, self.num_k_heads, self.head_k_dim),
            v.reshape(t, self.num_v_heads, self.head_v_dim),
        )

    def forward(
        self, x: torch.Tensor, state: RecurrentState, batch: RecurrentBatch
    ) -> torch.Tensor:
        t = x.shape[0]
        mixed = self.in_proj_qkv(x)  # [T, conv_dim]
        z = self.in_proj_z(x).view(t, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(x).sigmoid()  # [T, Hv]
        # fp32 so that a half-precision A never overflows to -inf
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        conv_pool = state.conv[:, self.linear_index]  # [N, C, K-1] views
        ssm_pool = state.ssm[:, self.linear_index]  # [N, Hv, Dk, Dv]
        weight = self.conv1d.weight.squeeze(1)
        o = x.new_empty(t, self.num_v_heads, self.head_v_dim)
        if batch.decode_rows is not None:
            rows, slots = batch.decode_rows, batch.decode_slots
            conv_out = ops.causal_conv1d_update(
                mixed[rows], conv_pool, weight, self.conv1d.bias, "silu", state_indices=slots
            )
            q, k, v = self._split_qkv(conv_out)
            o[rows], _ = ops.gated_delta_rule_decode(
                q, k, v, g[rows], beta[rows], ssm_pool, state_indices=slots
            )
        if batch.cu_seqlens is not None:
            rows, slots, fresh = batch.prefill_rows, batch.prefill_slots, batch.prefill_fresh
            take = (lambda a: a) if rows is None else (lambda a: a[rows])
            # Gathering by index copies, so clearing fresh rows leaves the pools untouched.
            conv_init = conv_pool[slots]
            conv_init[fresh] = 0
            ssm_init = ssm_pool[slots]
            ssm_init[fresh] = 0
            conv_out, conv_final = ops.causal_conv1d_prefill(
                take(mixed).t().unsqueeze(0),
                weight,
                self.conv1d.bias,
                conv_init,
                "silu",
                cu_seqlens=batch.cu_seqlens,
            )
            q, k, v = self._split_qkv(conv_out[0].t())
            out, ssm_final = ops.gated_delta_rule_prefill(
                q[None],
                k[None],
                v[None],
                take(g)[None],
                take(beta)[None],
                ssm_init,
                cu_seqlens=batch.cu_seqlens,
            )
            conv_pool[slots] = conv_final.to(conv_pool.dtype)
            ssm_pool[slots] = ssm_final.to(ssm_pool.dtype)
            if rows is None:
                o = out[0]
            else:
                o[rows] = out[0]
        o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.view(t, self.value_dim))


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: dict, layer_type: str, kind_index: int):
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.layer_type = layer_type
        if layer_type == LINEAR:
            self.linear_attn = Qwen3_5GatedDeltaNet(config, kind_index)
        else:
            self.self_attn = Qwen3_5GatedAttention(config, kind_index)
        self.mlp = GatedMLP(hidden, config["intermediate_size"])
        self.input_layernorm = RMSNorm(hidden, eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, zero_centered=True)

    def forward(self, x, positions, rotary, kv_cache, meta, state, batch):
        h = self.input_layernorm(x)
        if self.layer_type == LINEAR:
            h = self.linear_attn(h, state, batch)
        else:
            h = self.self_attn(h, positions, rotary, kv_cache, meta)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5Model(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        hidden = config["hidden_size"]
        self.layer_types = hybrid_layer_types_of(config)
        self.embed_tokens = nn.Embedding(config["vocab_size"], hidden)
        counts = {LINEAR: 0, FULL: 0}
        layers = []
        for kind in self.layer_types:
            layers.append(Qwen3_5DecoderLayer(config, kind, counts[kind]))
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6), zero_centered=True)


class Qwen3_5ForCausalLM(PagedCausalLM):
    def __init__(self, config: dict):
        rotary_dim = int(head_dim_of(config) * partial_rotary_factor_of(config))
        super().__init__(config, Qwen3_5Model(config), rotary_dim)
        self.linear_layers = [
            layer.linear_attn for layer in self.model.layers if layer.layer_type == LINEAR
        ]

    @property
    def num_attention_layers(self) -> int:
        """Full-attention layers: the ones with a paged KV cache."""
        return sum(1 for kind in self.model.layer_types if kind == FULL)

    @property
    def num_linear_layers(self) -> int:
        return len(self.linear_layers)

    def allocate_state(self, num_slots: int, device) -> RecurrentState:
        """Zeroed conv and SSM states for `num_slots` requests, all linear layers."""
        if not self.linear_layers:  # all full attention: nothing recurrent to keep
            conv_shape, ssm_shape = (0, 0), (0, 0, 0)
        else:
            conv_shape, ssm_shape = self.linear_layers[0].state_shapes()
        if any(layer.state_shapes() != (conv_shape, ssm_shape) for layer in self.linear_layers):
            raise ValueError("linear-attention layers disagree on their state shapes")
        dtype = self.lm_head.weight.dtype
        n = self.num_linear_layers
        return RecurrentState(
            conv=torch.zeros(num_slots, n, *conv_shape, dtype=dtype, device=device),
            ssm=torch.zeros(num_slots, n, *ssm_shape, dtype=torch.float32, device=device),
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        state: Optional[RecurrentState] = None,
    ) -> torch.Tensor:
        batch = None
        if self.linear_layers:
            if state is None:
                raise ValueError("Qwen3.5 needs its recurrent state (see allocate_state)")
            batch = RecurrentBatch.plan(meta, int(input_ids.shape[0]), input_ids.device)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, self.rotary, kv_cache, meta, state, batch)
        return self.model.norm(x)
