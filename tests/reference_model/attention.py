"""The reference's attention sublayer: standard (Megatron's QKV layout, GQA, RoPE, QK-norm) here,
multi-latent in tests/reference_model/mla.py; ``self_attention`` picks the one a config asks for."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reference_model.config import ReferenceGPTConfig
from reference_model.norm import ReferenceNorm
from reference_model.rope import apply_rotary


class ReferenceAttention(nn.Module):
    def __init__(self, config: ReferenceGPTConfig):
        super().__init__()
        self.config = config
        heads, groups, head_dim = (
            config.num_attention_heads,
            config.num_query_groups,
            config.kv_channels,
        )
        qkv_out = (heads + 2 * groups) * head_dim
        qkv_bias = config.add_bias_linear or config.add_qkv_bias
        self.linear_qkv = nn.Linear(config.hidden_size, qkv_out, bias=qkv_bias)
        self.linear_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=False)
        self.proj_bias = (
            nn.Parameter(torch.zeros(config.hidden_size)) if config.add_bias_linear else None
        )
        self.q_layernorm = ReferenceNorm(config, head_dim) if config.qk_layernorm else None
        self.k_layernorm = ReferenceNorm(config, head_dim) if config.qk_layernorm else None
        self.v_layernorm = ReferenceNorm(config, head_dim) if config.value_layernorm else None

    def forward(self, x: Tensor, rope) -> Tensor:
        """x: [b, s, h] -> (attention output without bias, bias)."""
        cfg = self.config
        b, s, _ = x.shape
        heads, groups, head_dim = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
        per_group = heads // groups
        mixed = self.linear_qkv(x).view(b, s, groups, (per_group + 2) * head_dim)
        q, k, v = mixed.split([per_group * head_dim, head_dim, head_dim], dim=-1)
        q = q.reshape(b, s, heads, head_dim)
        if self.q_layernorm is not None:  # per head, before RoPE, as Megatron's SelfAttention
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.v_layernorm is not None:  # per key/value head
            v = self.v_layernorm(v)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        k = k.repeat_interleave(per_group, dim=2)
        v = v.repeat_interleave(per_group, dim=2)
        compute = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for a double model
        scores = torch.einsum("bqhd,bkhd->bhqk", q.to(compute), k.to(compute)) / math.sqrt(head_dim)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1).to(x.dtype)
        probs = F.dropout(probs, cfg.attention_dropout, self.training)
        context = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, heads * head_dim)
        return self.linear_proj(context), self.proj_bias


def self_attention(config: ReferenceGPTConfig) -> nn.Module:
    """The attention sublayer ``config`` asks for: multi-latent (tests/reference_model/mla.py) or standard."""
    if config.multi_latent_attention:
        from reference_model.mla import ReferenceMLA  # it builds this module's norms

        return ReferenceMLA(config)
    return ReferenceAttention(config)
