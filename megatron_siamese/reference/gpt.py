"""A small, complete SiameseNorm GPT in plain PyTorch: the oracle for the Megatron model.

No Megatron import. Dense or mixture-of-experts MLPs (reference/moe.py, per ``moe_layer_freq``),
QK-norm in either variant, standard or multi-latent attention (reference/mla.py:
``multi_latent_attention``), and multi-token prediction after the decoder (reference/mtp.py:
``mtp_num_layers``). Module names mirror Megatron-Core's GPTModel built with
``get_siamese_block_spec`` (``embedding.word_embeddings``, ``decoder.layers.N.
self_attention.linear_qkv``, ``decoder.final_layernorm.merge.x_norm``, ...) so a TP=1
Megatron state dict loads with ``load_megatron_state_dict``. Attention follows Megatron's
layouts: ``linear_qkv`` rows are grouped per query group as [q heads, k, v], GQA repeats
each key/value head over its group, RoPE is Megatron's non-interleaved form, and gated
MLPs split ``linear_fc1`` into [gate, up] halves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron_siamese.reference.functional import (
    channel_scale,
    depth_scale,
    dual_norm,
    dual_residual,
    hybrid_dual_norm,
    merge_streams,
    normalize,
)
from megatron_siamese.reference.mlp import ACTIVATIONS, ReferenceMLP
from megatron_siamese.reference.rope import apply_rotary, rotary_cos_sin
from megatron_siamese.reference.moe import LOAD_BALANCING, ROUTER_DTYPES, ReferenceMoE, moe_layers, unmodelled_settings
from megatron_siamese.streams import split_streams


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
    value_layernorm: bool = False  # ... and of values (HybridNorm's QKV-norm: reference/single_stream.py)
    # the component study's ablations of the SiameseNorm block (SiameseTransformerConfig's
    # siamese_input_norm / siamese_depth_scale): without InputNorm, without c = sqrt(2 L)
    input_norm: bool = True
    depth_scaled: bool = True
    # mixture of experts (reference/moe.py); Megatron's names and defaults
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
    # multi-latent attention (reference/mla.py); MLATransformerConfig's names and defaults, but
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
    # multi-token prediction (reference/mtp.py); Megatron's names and defaults
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


class ReferenceNorm(nn.Module):
    def __init__(self, config: ReferenceGPTConfig, hidden_size: Optional[int] = None):
        super().__init__()
        size = hidden_size or config.hidden_size
        self.config = config
        gamma_init = 0.0 if config.layernorm_zero_centered_gamma else 1.0
        self.weight = nn.Parameter(torch.full((size,), gamma_init))
        self.bias = nn.Parameter(torch.zeros(size)) if config.normalization == "LayerNorm" else None

    def forward(self, x: Tensor) -> Tensor:
        return normalize(
            x,
            self.weight,
            self.bias,
            normalization=self.config.normalization,
            eps=self.config.layernorm_epsilon,
            zero_centered_gamma=self.config.layernorm_zero_centered_gamma,
        )


class ReferenceMerge(nn.Module):
    def __init__(self, config: ReferenceGPTConfig):
        super().__init__()
        self.x_norm = ReferenceNorm(config)
        self.y_norm = ReferenceNorm(config)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return merge_streams(self.x_norm(x), self.y_norm(y))


class ReferenceFinalNorm(ReferenceNorm):
    def __init__(self, config: ReferenceGPTConfig):
        super().__init__(config)
        self.merge = ReferenceMerge(config)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(self.merge(x, y))


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
    """The attention sublayer ``config`` asks for: multi-latent (reference/mla.py) or standard."""
    if config.multi_latent_attention:
        from megatron_siamese.reference.mla import ReferenceMLA  # it builds this module's norms

        return ReferenceMLA(config)
    return ReferenceAttention(config)


class ReferenceChannelScale(nn.Module):
    def __init__(self, config: ReferenceGPTConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(config.hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        return channel_scale(x, self.weight)


class ReferenceSiameseLayer(nn.Module):
    def __init__(self, config: ReferenceGPTConfig, layer_number: int, moe: bool = False):
        super().__init__()
        self.config = config
        self.depth_scale = depth_scale(layer_number, config.depth_scaled)
        hybrid = config.variant == "hybrid"
        self.attn_x_norm = ReferenceChannelScale(config) if hybrid else ReferenceNorm(config)
        self.attn_y_norm = ReferenceNorm(config)
        self.input_layernorm = None if hybrid or not config.input_norm else ReferenceNorm(config)
        self.self_attention = self_attention(config)
        self.mlp_x_norm = ReferenceNorm(config)
        self.mlp_y_norm = ReferenceNorm(config)
        self.pre_mlp_layernorm = ReferenceNorm(config) if config.input_norm else None
        self.mlp = ReferenceMoE(config) if moe else ReferenceMLP(config)

    def _norms(self, streams: Tensor, x_norm, y_norm, input_norm):
        cfg = self.config
        common = (cfg.layernorm_epsilon, cfg.normalization == "RMSNorm", cfg.layernorm_zero_centered_gamma)
        if isinstance(x_norm, ReferenceChannelScale):
            return hybrid_dual_norm(streams, cfg.hidden_size, x_norm.weight, y_norm.weight, y_norm.bias, *common)
        in_weight, in_bias = (None, None) if input_norm is None else (input_norm.weight, input_norm.bias)
        return dual_norm(streams, cfg.hidden_size, x_norm.weight, x_norm.bias, y_norm.weight, y_norm.bias,
                         in_weight, in_bias, *common)

    def _sublayer(self, streams: Tensor, x_norm, y_norm, input_norm, sublayer, *args) -> Tensor:
        base, normed = self._norms(streams, x_norm, y_norm, input_norm)
        out, bias = sublayer(normed, *args)
        p = self.config.hidden_dropout
        mask = (torch.empty_like(out, dtype=torch.bool).bernoulli_(1.0 - p)
                if self.training and p > 0.0 else None)
        return dual_residual(base, out, bias, mask, 1.0 / (1.0 - p), 1.0 / self.depth_scale)

    def forward(self, streams: Tensor, rope) -> Tensor:
        """Packed streams [b, s, 2h] (the embedding [b, s, h] at the first layer) -> [b, s, 2h]."""
        streams = self._sublayer(streams, self.attn_x_norm, self.attn_y_norm, self.input_layernorm,
                                 self.self_attention, rope)
        return self._sublayer(streams, self.mlp_x_norm, self.mlp_y_norm, self.pre_mlp_layernorm, self.mlp)


class ReferenceEmbedding(nn.Module):
    def __init__(self, config: ReferenceGPTConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = (
            nn.Embedding(config.max_sequence_length, config.hidden_size)
            if config.position_embedding_type == "learned_absolute"
            else None
        )

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        embeddings = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            embeddings = embeddings + self.position_embeddings(position_ids)
        return embeddings


class ReferenceDecoder(nn.Module):
    def __init__(self, config: ReferenceGPTConfig):
        super().__init__()
        pattern = (moe_layers(config.num_layers, config.moe_layer_freq) if config.num_moe_experts
                   else [False] * config.num_layers)
        self.layers = nn.ModuleList(
            ReferenceSiameseLayer(config, layer_number=i + 1, moe=moe) for i, moe in enumerate(pattern)
        )
        self.final_layernorm = ReferenceFinalNorm(config)


class ReferenceGPT(nn.Module):
    """Embedding, N SiameseNorm blocks, the merging final norm and the output head; with
    ``mtp_num_layers``, Megatron's multi-token prediction layers after the final norm
    (reference/mtp.py), sharing the embedding and the output head."""

    def __init__(self, config: ReferenceGPTConfig):
        super().__init__()
        self.config = config
        self.embedding = ReferenceEmbedding(config)
        self.decoder = self._decoder(config)
        self.output_layer = (
            None
            if config.share_embeddings_and_output_weights
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        if config.mtp_num_layers:
            from megatron_siamese.reference.mtp import ReferenceMTPBlock  # it builds on this module

            self.mtp = ReferenceMTPBlock(config)
        else:
            self.mtp = None

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        """input_ids [b, s] -> logits [b, s, vocab] (the main head's)."""
        hidden, _, _ = self._hidden(input_ids, position_ids)
        return self._logits(hidden)

    def _hidden(self, input_ids: Tensor, position_ids: Optional[Tensor]):
        """(the final norm's output [b, s, h], the RoPE the layers got, the position ids)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(
                input_ids
            )
        hidden = self._embed(input_ids, position_ids)
        # multi-latent attention builds its own RoPE (GPTModel builds none for it)
        rope = (
            rotary_cos_sin(self.config, position_ids)
            if self.config.position_embedding_type == "rope" and not self.config.multi_latent_attention
            else None
        )
        return self._decode(hidden, rope), rope, position_ids

    def _embed(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        hidden = self.embedding(input_ids, position_ids)
        return F.dropout(hidden, self.config.hidden_dropout, self.training)

    def _logits(self, hidden: Tensor) -> Tensor:
        head = (
            self.embedding.word_embeddings.weight
            if self.output_layer is None
            else self.output_layer.weight
        )
        return hidden @ head.t()

    def _decoder(self, config: ReferenceGPTConfig) -> nn.Module:
        return ReferenceDecoder(config)

    def _decode(self, hidden: Tensor, rope) -> Tensor:
        """The embedding's output [b, s, h] -> the final norm's [b, s, h]."""
        streams = hidden  # x = y = the embedding
        for layer in self.decoder.layers:
            streams = layer(streams, rope)
        return self.decoder.final_layernorm(*split_streams(streams, self.config.hidden_size))

    @staticmethod
    def _cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(  # in fp32 (Megatron's), fp64 for a double model
            logits.to(torch.promote_types(logits.dtype, torch.float32)).flatten(0, 1), labels.flatten(),
            reduction="none",
        ).view_as(labels)

    def loss(self, input_ids: Tensor, labels: Tensor, position_ids: Optional[Tensor] = None):
        """Per-token cross-entropy [b, s], like GPTModel called with labels."""
        return self._cross_entropy(self.forward(input_ids, position_ids), labels)

    def losses(self, input_ids: Tensor, labels: Tensor, position_ids: Optional[Tensor] = None,
               loss_mask: Optional[Tensor] = None):
        """(the main head's per-token cross-entropy [b, s], [L_1, ..., L_D]) in one forward:
        L_k the masked mean cross-entropy of MTP depth k against the labels rolled k times, the
        loss mask (ones when None, as GPTModel called without one) rolled alike (reference/mtp.py;
        [] without MTP)."""
        hidden, rope, position_ids = self._hidden(input_ids, position_ids)
        main = self._cross_entropy(self._logits(hidden), labels)
        if self.mtp is None:
            return main, []
        from megatron_siamese.reference.mtp import rolled_targets

        mask = torch.ones_like(labels) if loss_mask is None else loss_mask
        depth_losses = []
        for depth, out in enumerate(self.mtp(hidden, input_ids, position_ids, self._embed, rope), start=1):
            depth_labels, depth_mask = rolled_targets(labels, mask, depth)
            per_token = self._cross_entropy(self._logits(out), depth_labels)
            # no token left to score (a sequence no longer than the depth): 0, as megatron-core 0.19
            depth_losses.append((depth_mask * per_token).sum() / depth_mask.sum().clamp(min=1))
        return main, depth_losses

    def router_loss(self) -> Tensor:
        """The MoE layers' aux and z losses of the last training forward (0 without any), the MTP
        layers' included."""
        layers = list(self.decoder.layers)
        if self.mtp is not None:
            layers += [layer.transformer_layer for layer in self.mtp.layers]
        losses = [layer.mlp.router_loss for layer in layers
                  if isinstance(layer.mlp, ReferenceMoE) and layer.mlp.router_loss is not None]
        return sum(losses) if losses else torch.zeros(())

    def objective(self, input_ids: Tensor, labels: Tensor, position_ids: Optional[Tensor] = None,
                  loss_mask: Optional[Tensor] = None) -> Tensor:
        """What Megatron's backward differentiates for one microbatch: the mean cross-entropy
        (masked mean with ``loss_mask``), the router losses, to which MoEAuxLossAutoScaler gives
        the main loss's gradient scale, and ``mtp_loss_scaling_factor / D`` times each MTP
        depth's loss, which MTPLossAutoScaler scales alike (Megatron's schedules scale all by
        1 / num_microbatches: a step's objective is the mean of this over its microbatches)."""
        main, depth_losses = self.losses(input_ids, labels, position_ids, loss_mask)
        main = main.mean() if loss_mask is None else (main * loss_mask).sum() / loss_mask.sum()
        objective = main + self.router_loss()
        if depth_losses:
            objective = objective + self.config.mtp_loss_scaling_factor / len(depth_losses) * sum(depth_losses)
        return objective

    def load_megatron_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Load a TP=1 Megatron GPTModel state dict (either SiameseNorm spec)."""
        self.load_state_dict(megatron_to_reference_names(state_dict, self.config.num_layers))


def megatron_to_reference_names(state_dict: Mapping[str, Tensor], num_layers: int) -> Dict[str, Tensor]:
    """Rename a Megatron SiameseNorm GPT state dict to the reference's parameter names.

    Megatron returns biases of ``linear_proj`` / ``linear_fc2`` separately (they go through
    bias-dropout), the reference keeps them as ``proj_bias`` / ``fc2_bias`` (an expert's too,
    though its MLP adds it itself, scaled by the token's routing probability); a layer-spec
    model (Megatron-LM ``--spec``) keeps the merge norms in its last layer's
    ``output_merge`` and its FinalNorm as ``decoder.final_layernorm``; an MTP layer's transformer
    layer is ``mtp.layers.K.transformer_layer`` (megatron-core 0.16) or ``mtp_model_layer``
    (0.19), the reference's ``transformer_layer``.
    """
    last = f"decoder.layers.{num_layers - 1}.output_merge."
    renamed = {}
    for name, tensor in state_dict.items():
        if name.endswith("_extra_state"):
            continue
        name = name.replace("self_attention.linear_proj.bias", "self_attention.proj_bias")
        name = name.replace("linear_fc2.bias", "fc2_bias")
        if name.startswith("mtp.layers."):
            name = name.replace(".mtp_model_layer.", ".transformer_layer.", 1)
        if name.startswith(last):
            name = "decoder.final_layernorm.merge." + name[len(last):]
        renamed[name] = tensor
    return renamed
