"""SiameseNorm GPT for Hugging Face Transformers: the model ``megatron-siamese export`` writes.

Self-contained: it imports only torch and transformers, because it is copied next to the
weights of every exported directory and loaded from there with ``trust_remote_code=True``
(the ``auto_map`` in ``config.json`` names ``SiameseNormConfig`` and
``SiameseNormForCausalLM``). It computes what megatron_siamese's Megatron layers compute
(megatron_siamese/reference/functional.py holds the equations), at fp32 within rounding:

Two residual streams share every sublayer's weights. For sublayer k of layer L (1-based),
c = sqrt(2 L):

    u = PostNorm_k(x);  z = Sublayer_k(InputNorm_k(u + PreNorm_k(y)));  x = u + z / c;  y = y + z

with x = y = the embedding before the first layer and logits = head(FinalNorm(NormX(x) +
NormY(y))). The "hybrid" variant's attention sublayer sees c1 * x + PreNorm(y) (c1 a learned
per-channel scale; no PostNorm, no InputNorm, QK-norm in attention) and the X stream continues from x.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

# transformers 5.24 renamed the KV cache's argument and output field from ``past_key_values`` to ``cache``
# (the old name warns); the model speaks the installed release's name both ways, so neither side is told off
CACHE = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}
POSITIONS = ("rope", "learned_absolute")
VARIANTS = ("standard", "hybrid")


class SiameseNormConfig(PretrainedConfig):
    """The model's shape and numerics (Megatron's meaning for every field named like its own)."""

    model_type = "megatron_siamese"
    keys_to_ignore_at_inference = [CACHE]

    def __init__(
        self,
        vocab_size: int = 320,
        hidden_size: int = 128,
        intermediate_size: int = 512,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        max_position_embeddings: int = 128,
        normalization: str = "RMSNorm",
        norm_eps: float = 1e-5,
        zero_centered_gamma: bool = False,
        hidden_act: str = "silu",
        gated_mlp: bool = True,
        add_bias_linear: bool = False,
        add_qkv_bias: bool = False,
        position_embedding_type: str = "rope",
        rope_theta: float = 10000.0,
        rotary_percent: float = 1.0,
        rotary_interleaved: bool = False,
        siamese_variant: str = "standard",
        qk_layernorm: bool = False,
        tie_word_embeddings: bool = True,
        use_cache: bool = True,
        bos_token_id: Optional[int] = 256,
        eos_token_id: Optional[int] = 256,
        pad_token_id: Optional[int] = 257,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.normalization = normalization
        self.norm_eps = norm_eps
        self.zero_centered_gamma = zero_centered_gamma
        self.hidden_act = hidden_act
        self.gated_mlp = gated_mlp
        self.add_bias_linear = add_bias_linear
        self.add_qkv_bias = add_qkv_bias
        self.position_embedding_type = position_embedding_type
        self.rope_theta = rope_theta
        self.rotary_percent = rotary_percent
        self.rotary_interleaved = rotary_interleaved
        self.siamese_variant = siamese_variant
        self.qk_layernorm = qk_layernorm
        self.use_cache = use_cache
        for name, value, allowed in (("normalization", normalization, NORMALIZATIONS),
                                     ("hidden_act", hidden_act, tuple(ACTIVATIONS)),
                                     ("position_embedding_type", position_embedding_type, POSITIONS),
                                     ("siamese_variant", siamese_variant, VARIANTS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if siamese_variant == "hybrid" and not qk_layernorm:
            raise ValueError("the hybrid variant normalizes queries and keys: set qk_layernorm=True")
        super().__init__(tie_word_embeddings=tie_word_embeddings, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the last dimension in fp32, cast back (gamma = 1 + w when zero-centred)."""

    def __init__(self, config: SiameseNormConfig, size: Optional[int] = None):
        super().__init__()
        size = size or config.hidden_size
        self.rms = config.normalization == "RMSNorm"
        self.eps = config.norm_eps
        self.zero_centered_gamma = config.zero_centered_gamma
        self.weight = nn.Parameter(torch.zeros(size) if self.zero_centered_gamma else torch.ones(size))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        gamma = self.weight.float() + 1.0 if self.zero_centered_gamma else self.weight.float()
        if self.rms:
            out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * gamma
        else:
            centered = x32 - x32.mean(-1, keepdim=True)
            out = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + self.eps) * gamma
            out = out + self.bias.float()
        return out.to(x.dtype)


class ChannelScale(nn.Module):
    """The hybrid variant's c1: a learned per-channel scale of the X stream."""

    def __init__(self, config: SiameseNormConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(config.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Rotary(nn.Module):
    """Megatron's RoPE: inv_freq over the first ``rotary_percent`` of each head, halves rotated
    (or interleaved pairs), applied to queries and keys in their own dtype."""

    def __init__(self, config: SiameseNormConfig):
        super().__init__()
        dim = config.head_dim
        if config.rotary_percent < 1.0:
            dim = int(dim * config.rotary_percent)
        self.dim, self.base, self.interleaved = dim, config.rope_theta, config.rotary_interleaved

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        """[b, s] positions -> [b, s, 1, rot_dim] angles."""
        # computed here, not kept as a buffer: transformers builds models on the meta device and
        # would leave a non-persistent buffer uninitialized
        steps = torch.arange(0, self.dim, 2, dtype=torch.float32, device=position_ids.device)
        inv_freq = 1.0 / (self.base ** (steps / self.dim))
        freqs = position_ids.to(torch.float32)[..., None] * inv_freq
        if self.interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, :, None, :]

    def apply(self, t: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        rot_dim = angles.shape[-1]
        t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
        if self.interleaved:
            rotated = torch.stack((-t_rot[..., 1::2], t_rot[..., ::2]), dim=-1).flatten(-2)
        else:
            first, second = t_rot.chunk(2, dim=-1)
            rotated = torch.cat((-second, first), dim=-1)
        t_rot = t_rot * angles.cos().to(t.dtype) + rotated * angles.sin().to(t.dtype)
        return torch.cat((t_rot, t_pass), dim=-1)


class SiameseNormAttention(nn.Module):
    def __init__(self, config: SiameseNormConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.groups, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        qkv_bias = config.add_bias_linear or config.add_qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.groups * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.groups * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=config.add_bias_linear)
        self.q_norm = Norm(config, self.head_dim) if config.qk_layernorm else None
        self.k_norm = Norm(config, self.head_dim) if config.qk_layernorm else None

    def forward(self, x, angles, rotary, mask, cache: Optional[Cache]):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.groups, self.head_dim)
        v = self.v_proj(x).view(b, s, self.groups, self.head_dim)
        if self.q_norm is not None:  # per head, before RoPE (Megatron's order)
            q, k = self.q_norm(q), self.k_norm(k)
        if angles is not None:
            q, k = rotary.apply(q, angles), rotary.apply(k, angles)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, s, d]
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        per_group = self.heads // self.groups
        k, v = k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(self.head_dim)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(v.dtype)
        context = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.o_proj(context)


class SiameseNormMLP(nn.Module):
    def __init__(self, config: SiameseNormConfig):
        super().__init__()
        self.gated = config.gated_mlp
        self.act = ACTIVATIONS[config.hidden_act]
        bias = config.add_bias_linear
        if self.gated:
            self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x):
        hidden = self.act(self.gate_proj(x)) * self.up_proj(x) if self.gated else self.act(self.up_proj(x))
        return self.down_proj(hidden)


def dual_residual(base_x: torch.Tensor, y: torch.Tensor, z: torch.Tensor, c: float):
    """x = base_x + z / c, y = y + z, in fp32 and rounded once (as Megatron's fused op)."""
    z32 = z.float()
    return (base_x.float() + z32 / c).to(base_x.dtype), (y.float() + z32).to(y.dtype)


class SiameseNormDecoderLayer(nn.Module):
    """One GPT block: a SiameseNorm attention sublayer, then a SiameseNorm MLP sublayer."""

    def __init__(self, config: SiameseNormConfig, layer_idx: int):
        super().__init__()
        self.depth_scale = math.sqrt(2.0 * (layer_idx + 1))  # c = sqrt(2 L), L global and 1-based
        self.hybrid = config.siamese_variant == "hybrid"
        if self.hybrid:
            self.attn_x_scale = ChannelScale(config)
        else:
            self.attn_x_norm = Norm(config)
            self.input_layernorm = Norm(config)
        self.attn_y_norm = Norm(config)
        self.self_attn = SiameseNormAttention(config, layer_idx)
        self.mlp_x_norm = Norm(config)
        self.mlp_y_norm = Norm(config)
        self.post_attention_layernorm = Norm(config)  # the MLP's InputNorm (Llama's name)
        self.mlp = SiameseNormMLP(config)

    def forward(self, x, y, angles, rotary, mask, cache):
        if self.hybrid:
            base_x, normed = x, self.attn_x_scale(x) + self.attn_y_norm(y)
        else:
            base_x = self.attn_x_norm(x)
            normed = self.input_layernorm(base_x + self.attn_y_norm(y))
        x, y = dual_residual(base_x, y, self.self_attn(normed, angles, rotary, mask, cache), self.depth_scale)
        u = self.mlp_x_norm(x)
        z = self.mlp(self.post_attention_layernorm(u + self.mlp_y_norm(y)))
        return dual_residual(u, y, z, self.depth_scale)


class SiameseNormPreTrainedModel(PreTrainedModel):
    config_class = SiameseNormConfig
    base_model_prefix = "model"
    _no_split_modules = ["SiameseNormDecoderLayer"]
    _supports_cache_class = True

    def _init_weights(self, module):
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


class SiameseNormModel(SiameseNormPreTrainedModel):
    def __init__(self, config: SiameseNormConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = (nn.Embedding(config.max_position_embeddings, config.hidden_size)
                                if config.position_embedding_type == "learned_absolute" else None)
        self.rotary = Rotary(config) if config.position_embedding_type == "rope" else None
        self.layers = nn.ModuleList(SiameseNormDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm_x = Norm(config)
        self.norm_y = Norm(config)
        self.norm = Norm(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, use_cache=None, past_key_values=None, **kwargs) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        cache = past_key_values if cache is None else cache  # the name transformers < 5.24 passes
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, s = hidden.shape[:2]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            if attention_mask is not None and attention_mask.dim() == 2:  # left padding: count real tokens
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -s:]
            else:
                position_ids = torch.arange(past, past + s, device=hidden.device)[None].expand(b, -1)
        if self.embed_positions is not None:
            hidden = hidden + self.embed_positions(position_ids)
        angles = self.rotary(position_ids) if self.rotary is not None else None
        mask = self._mask(attention_mask, b, s, past, hidden.device)
        x = y = hidden
        for layer in self.layers:
            x, y = layer(x, y, angles, self.rotary, mask, cache)
        out = self.norm(self.norm_x(x) + self.norm_y(y))
        return BaseModelOutputWithPast(last_hidden_state=out, **{CACHE: cache if use_cache else None})

    @staticmethod
    def _mask(attention_mask, b: int, s: int, past: int, device) -> torch.Tensor:
        """[b, 1, s, past + s] booleans: causal, minus padded keys; every query sees itself (a
        padded query's output is unused, and a row of nothing would be NaN)."""
        total = past + s
        query = torch.arange(past, total, device=device)[:, None]
        key = torch.arange(total, device=device)[None, :]
        mask = (key <= query)[None, None].expand(b, 1, s, total)
        if attention_mask is not None:
            if attention_mask.dim() == 4:
                return attention_mask.bool() if attention_mask.dtype == torch.bool else attention_mask == 0
            keys = attention_mask[:, -total:].bool()[:, None, None, :]
            mask = (mask & keys) | (key == query)[None, None]
        return mask


class SiameseNormForCausalLM(SiameseNormPreTrainedModel, GenerationMixin):
    def __init__(self, config: SiameseNormConfig):
        super().__init__(config)
        self.model = SiameseNormModel(config)
        # tied: the logits use the embedding itself, so no second copy exists to drift
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, past_key_values=None,
                **kwargs) -> CausalLMOutputWithPast:
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=past_key_values if cache is None else cache, inputs_embeds=inputs_embeds,
                             use_cache=use_cache)
        hidden = outputs.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, head)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE: getattr(outputs, CACHE)})


SiameseNormConfig.register_for_auto_class()
SiameseNormForCausalLM.register_for_auto_class("AutoModelForCausalLM")
