"""The reference GPT's settings (``ReferenceGPTConfig``): TransformerConfig's names and meanings
for what the reference models, and ``from_megatron``, which refuses what it does not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Union

import torch.nn.functional as F

from reference_model.mlp import ACTIVATIONS
from reference_model.moe import LOAD_BALANCING, ROUTER_DTYPES, moe_layers, unmodelled_settings


# the fields ReferenceGPTConfig shares, by name and meaning, with Megatron's TransformerConfig
_MEGATRON_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups", "kv_channels",
    "normalization", "layernorm_epsilon", "layernorm_zero_centered_gamma", "add_bias_linear", "add_qkv_bias",
    "gated_linear_unit", "hidden_dropout", "attention_dropout", "qk_layernorm",
    "num_moe_experts", "moe_router_topk", "moe_layer_freq", "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor", "moe_router_dtype", "moe_aux_loss_coeff", "moe_z_loss_coeff",
    "moe_router_load_balancing_type", "mtp_num_layers", "mtp_loss_scaling_factor",
)
# ... and with multi-latent attention (MLATransformerConfig's; the RoPE ones are MLA's own RoPE's)
_MLA_FIELDS = (
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "rope_type", "rotary_base", "rotary_percent", "rotary_scaling_factor", "original_max_position_embeddings",
    "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
)
# Megatron settings the reference has no math for: set (not None / False / the value named) and
# from_megatron refuses rather than compute something else
_UNMODELLED = {
    "mtp_use_repeated_layer": None,  # megatron-core 0.19: one MTP layer applied D times
    "mtp_detach_heads": None,  # 0.19: the MTP losses reach neither the embedding nor the output head
    "apply_query_key_layer_scaling": None,
    "cache_mla_latents": None,
}


@dataclass
class ReferenceGPTConfig:
    vocab_size: int
    max_sequence_length: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: Optional[int] = None
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    gated_linear_unit: bool = False
    activation: str = "gelu"
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    share_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    variant: str = "standard"  # or "hybrid": see reference/functional.py
    qk_layernorm: bool = False  # per-head norms of queries and keys (the hybrid variant always has them)
    value_layernorm: bool = False  # ... and of values (HybridNorm's QKV-norm: tests/reference_model/single_stream.py)
    # the component study's ablations of the SiameseNorm block (SiameseTransformerConfig's
    # siamese_input_norm / siamese_depth_scale): without InputNorm, without c = sqrt(2 L)
    input_norm: bool = True
    depth_scaled: bool = True
    # mixture of experts (tests/reference_model/moe.py); Megatron's names and defaults
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_layer_freq: Union[int, List[int]] = 1
    moe_ffn_hidden_size: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_dtype: Optional[str] = None
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_router_load_balancing_type: str = "aux_loss"
    # multi-latent attention (tests/reference_model/mla.py); MLATransformerConfig's names and defaults, but
    # for q_lora_rank (None: queries projected directly). Its RoPE uses rotary_base and
    # rotary_percent above; the model then has no RoPE of its own (as Megatron's GPTModel)
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rope_type: str = "yarn"  # or "rope"
    rotary_scaling_factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # multi-token prediction (tests/reference_model/mtp.py); Megatron's names and defaults
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: float = 0.1

    def __post_init__(self):
        self.ffn_hidden_size = self.ffn_hidden_size or 4 * self.hidden_size
        self.num_query_groups = self.num_query_groups or self.num_attention_heads
        self.kv_channels = self.kv_channels or self.hidden_size // self.num_attention_heads
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ValueError("position_embedding_type must be 'learned_absolute' or 'rope'")
        if self.variant not in ("standard", "hybrid"):
            raise ValueError("variant must be 'standard' or 'hybrid'")
        if self.variant == "hybrid" and not self.qk_layernorm:
            raise ValueError("the hybrid variant normalizes queries and keys: set qk_layernorm=True")
        if self.num_moe_experts:
            self._check_moe()
        if self.multi_latent_attention:
            if self.rope_type not in ("rope", "yarn"):
                raise ValueError("rope_type must be 'rope' or 'yarn'")
            if self.variant != "standard" or self.value_layernorm:
                raise ValueError("multi-latent attention is the standard variant's, without a value norm")
        if self.mtp_num_layers is not None and self.mtp_num_layers < 1:
            raise ValueError("mtp_num_layers must be at least 1 (None: no multi-token prediction)")

    def _check_moe(self):
        self.moe_ffn_hidden_size = self.moe_ffn_hidden_size or self.ffn_hidden_size
        moe_layers(self.num_layers, self.moe_layer_freq)  # a pattern of the wrong length fails here
        if not 1 <= self.moe_router_topk <= self.num_moe_experts:
            raise ValueError(f"moe_router_topk must be in 1..{self.num_moe_experts}")
        if self.moe_router_topk == 1 and not self.moe_router_pre_softmax:
            raise ValueError("top-1 routing needs moe_router_pre_softmax=True (a softmax over one logit is constant)")
        if self.moe_router_load_balancing_type not in LOAD_BALANCING:
            raise ValueError(f"moe_router_load_balancing_type must be one of {LOAD_BALANCING}")
        if self.moe_router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"moe_router_dtype must be one of {sorted(filter(None, ROUTER_DTYPES))} or None")

    @classmethod
    def from_megatron(cls, config, vocab_size: int, max_sequence_length: int, **overrides):
        """Read the matching fields off a Megatron TransformerConfig (duck-typed)."""
        activation = {F.gelu: "gelu", F.silu: "silu"}.get(config.activation_func)
        if activation is None:
            raise ValueError(f"no reference for activation {config.activation_func}")
        if config.num_moe_experts and unmodelled_settings(config):
            raise ValueError(f"no reference for {', '.join(unmodelled_settings(config))}")
        unmodelled = [f"{name}={getattr(config, name)!r}" for name, default in _UNMODELLED.items()
                      if getattr(config, name, None) not in (None, False, default)]
        if config.mtp_num_layers and getattr(config, "calculate_per_token_loss", False):
            unmodelled.append("calculate_per_token_loss=True (with multi-token prediction)")
        if unmodelled:
            raise ValueError(f"no reference for {', '.join(unmodelled)}")
        fields = {name: getattr(config, name) for name in _MEGATRON_FIELDS}
        if getattr(config, "multi_latent_attention", False):
            fields.update({name: getattr(config, name) for name in _MLA_FIELDS})
        fields.update(vocab_size=vocab_size, max_sequence_length=max_sequence_length, activation=activation,
                      input_norm=getattr(config, "siamese_input_norm", True),
                      depth_scaled=getattr(config, "siamese_depth_scale", True))
        fields.update(overrides)
        return cls(**fields)
