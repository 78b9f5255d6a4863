"""Multi-latent attention (DeepSeek's MLA) in plain PyTorch: the oracle for Megatron's
``MLASelfAttention`` (``megatron/core/transformer/multi_latent_attention.py``,
``get_query_key_value_tensors``, megatron-core 0.16.1 and 0.19.2 alike) on one rank.

For x [b, s, h], n heads, each query/key head of ``qk_head_dim`` channels without position and
``qk_pos_emb_head_dim`` (p) with RoPE, each value head of ``v_head_dim``:

    q = linear_q_proj(x)                                   # q_lora_rank None
      = linear_q_up_proj(q_layernorm(linear_q_down_proj(x)))   # else
    q -> per head [q_nope (qk_head_dim) | q_pe (p)]
    [c_kv | k_pe] = linear_kv_down_proj(x)                 # c_kv: kv_lora_rank wide, k_pe: p wide
    kv = linear_kv_up_proj(kv_layernorm(c_kv)) -> per head [k_nope (qk_head_dim) | v (v_head_dim)]
    query = [q_nope | RoPE(q_pe)];  key = [k_nope | RoPE(k_pe)]   # one k_pe shared by every head
    out = linear_proj(softmax_causal(query key^T * scale) v)

RoPE is MLA's own (tests/reference_model/rope.py ``mla_rotary_cos_sin`` / ``apply_mla_rotary``): the
angles of positions 0..s-1 (``rope_type`` "rope" or "yarn", cos and sin times YaRN's
concentration factor), the position part's even channels then its odd ones rotated
non-interleaved, left in that order (queries and keys alike). The softmax scale is
``mscale^2 / sqrt(qk_head_dim + p)`` with ``mscale = yarn_get_mscale(rotary_scaling_factor,
mscale_all_dim)``, whatever the ``rope_type`` (``MultiLatentAttention.__init__``). The latent
norms exist only with ``qk_layernorm`` (else Megatron's IdentityOp), ``q_layernorm`` only with
``q_lora_rank``. No projection but ``linear_proj`` has a bias; that one is kept apart
(``proj_bias``), as the reference's other attention keeps it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reference_model.norm import ReferenceNorm
from reference_model.rope import apply_mla_rotary, mla_rotary_cos_sin, yarn_get_mscale


def mla_softmax_scale(config) -> float:
    """MultiLatentAttention's softmax scale (``config``: a ReferenceGPTConfig)."""
    mscale = yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
    return mscale * mscale / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


class ReferenceMLA(nn.Module):
    def __init__(self, config):
        """``config``: a ReferenceGPTConfig with ``multi_latent_attention``."""
        super().__init__()
        self.config = config
        heads, hidden = config.num_attention_heads, config.hidden_size
        q_head = config.qk_head_dim + config.qk_pos_emb_head_dim
        if config.q_lora_rank is None:
            self.linear_q_proj = nn.Linear(hidden, heads * q_head, bias=False)
        else:
            self.linear_q_down_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
            self.linear_q_up_proj = nn.Linear(config.q_lora_rank, heads * q_head, bias=False)
        self.linear_kv_down_proj = nn.Linear(hidden, config.kv_lora_rank + config.qk_pos_emb_head_dim, bias=False)
        self.linear_kv_up_proj = nn.Linear(config.kv_lora_rank, heads * (config.qk_head_dim + config.v_head_dim),
                                           bias=False)
        latent_norms = config.qk_layernorm
        self.q_layernorm = (ReferenceNorm(config, config.q_lora_rank)
                            if latent_norms and config.q_lora_rank is not None else None)
        self.kv_layernorm = ReferenceNorm(config, config.kv_lora_rank) if latent_norms else None
        self.linear_proj = nn.Linear(heads * config.v_head_dim, hidden, bias=False)
        self.proj_bias = nn.Parameter(torch.zeros(hidden)) if config.add_bias_linear else None

    def queries(self, x: Tensor) -> Tensor:
        """x [b, s, h] -> q [b, s, n, qk_head_dim + qk_pos_emb_head_dim] (before RoPE)."""
        cfg = self.config
        if cfg.q_lora_rank is None:
            q = self.linear_q_proj(x)
        else:
            latent = self.linear_q_down_proj(x)
            if self.q_layernorm is not None:
                latent = self.q_layernorm(latent)
            q = self.linear_q_up_proj(latent)
        return q.view(*x.shape[:2], cfg.num_attention_heads, cfg.qk_head_dim + cfg.qk_pos_emb_head_dim)

    def keys_values(self, x: Tensor):
        """x [b, s, h] -> (k_nope [b, s, n, qk_head_dim], k_pe [b, s, 1, p] before RoPE, v [b, s, n, v_head_dim])."""
        cfg = self.config
        latent, k_pe = self.linear_kv_down_proj(x).split([cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        kv = self.linear_kv_up_proj(latent).view(*x.shape[:2], cfg.num_attention_heads, cfg.qk_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_head_dim, cfg.v_head_dim], dim=-1)
        return k_nope, k_pe[:, :, None, :], v

    def rotary(self, q: Tensor, k_nope: Tensor, k_pe: Tensor):
        """(query, key) [b, s, n, qk_head_dim + p]: each head's last p channels, the queries' own
        and the keys' shared ``k_pe``, rotated by MLA's RoPE (positions 0..s-1)."""
        cfg = self.config
        cos, sin = mla_rotary_cos_sin(cfg, q.shape[1])
        q_nope, q_pe = q.split([cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        query = torch.cat([q_nope, apply_mla_rotary(q_pe, cos, sin)], dim=-1)
        k_pe = apply_mla_rotary(k_pe, cos, sin).expand(-1, -1, cfg.num_attention_heads, -1)
        return query, torch.cat([k_nope, k_pe], dim=-1)

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Causal softmax(query key^T * MLA's scale) value, per head -> [b, s, n * v_head_dim]."""
        b, s, heads, _ = query.shape
        compute = torch.promote_types(query.dtype, torch.float32)  # fp32, or fp64 for a double model
        scores = torch.einsum("bqhd,bkhd->bhqk", query.to(compute), key.to(compute)) * mla_softmax_scale(self.config)
        causal = torch.ones(s, s, dtype=torch.bool, device=query.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1).to(value.dtype)
        probs = F.dropout(probs, self.config.attention_dropout, self.training)
        return torch.einsum("bhqk,bkhd->bqhd", probs, value).reshape(b, s, heads * value.shape[-1])

    def forward(self, x: Tensor, rope=None):
        """x [b, s, h] -> (attention output without bias, bias). ``rope`` must be None: MLA builds
        its own RoPE (Megatron's GPTModel hands MLA none)."""
        if rope is not None:
            raise ValueError("multi-latent attention builds its own RoPE: the model passes none")
        k_nope, k_pe, value = self.keys_values(x)
        query, key = self.rotary(self.queries(x), k_nope, k_pe)
        return self.linear_proj(self.attend(query, key, value)), self.proj_bias
