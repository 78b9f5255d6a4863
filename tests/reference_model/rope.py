"""Megatron's non-interleaved rotary position embedding (RoPE), for the reference's attention, and
multi-latent attention's RoPE and YaRN (tests/reference_model/mla.py)."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor


def rotary_cos_sin(config, positions: Tensor):
    """cos, sin of shape [b, s, 1, rot_dim] for Megatron's non-interleaved RoPE (``config``: a
    ReferenceGPTConfig; angles in fp32, as Megatron's)."""
    rot_dim = int(config.kv_channels * config.rotary_percent)
    inv_freq = 1.0 / (
        config.rotary_base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    )
    freqs = positions.float()[..., None] * inv_freq  # [b, s, rot_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
    return emb.cos(), emb.sin()


def apply_rotary(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    rot_dim = cos.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    first, second = t_rot.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    t_rot = t_rot * cos.to(t.dtype) + rotated * sin.to(t.dtype)
    return torch.cat([t_rot, t_pass], dim=-1)


# -- multi-latent attention's RoPE (tests/reference_model/mla.py): Megatron's RotaryEmbedding or YarnRotaryEmbedding
# built inside MLASelfAttention on the qk_pos_emb_head_dim-wide position part of each head


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention factor 0.1 m ln(s) + 1 (1 for s <= 1): Megatron's ``_yarn_get_mscale``."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_concentration_factor(scaling_factor: float, mscale: Optional[float], mscale_all_dim: Optional[float]) -> float:
    """The factor YaRN multiplies cos and sin by: mscale(s, mscale) / mscale(s, mscale_all_dim)
    (Megatron's ``_yarn_get_concentration_factor``)."""
    if mscale is None or mscale_all_dim is None:
        return yarn_get_mscale(scaling_factor)
    return float(yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(scaling_factor, mscale_all_dim))


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_positions: int) -> float:
    return (dim * math.log(max_positions / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, scaling_factor: float, original_max_position_embeddings: int,
                  beta_fast: float, beta_slow: float) -> Tensor:
    """YaRN's per-pair frequencies [dim / 2], fp32: the interpolated ones (divided by the scaling
    factor) below the correction range, the original ones above it, a linear ramp between."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    extrapolated = 1.0 / (base ** exponents)
    interpolated = 1.0 / (scaling_factor * base ** exponents)
    low = max(math.floor(_yarn_correction_dim(beta_fast, dim, base, original_max_position_embeddings)), 0)
    high = min(math.ceil(_yarn_correction_dim(beta_slow, dim, base, original_max_position_embeddings)), dim - 1)
    if low == high:
        high += 0.001  # as Megatron: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated_share = 1.0 - ramp
    return interpolated * (1 - extrapolated_share) + extrapolated * extrapolated_share


def mla_rotary_cos_sin(config, seq_len: int) -> Tuple[Tensor, Tensor]:
    """cos and sin [s, 1, rot_dim] of multi-latent attention's RoPE at positions 0..s-1 (MLA takes
    no position ids: Megatron builds the angles from the sequence length), already multiplied by
    YaRN's concentration factor as Megatron does, in fp32 (``config``: a ReferenceGPTConfig).

    ``rope_type`` "rope": Megatron's ``RotaryEmbedding`` over ``qk_pos_emb_head_dim`` (times
    ``rotary_percent``); "yarn": ``YarnRotaryEmbedding`` over all of ``qk_pos_emb_head_dim``."""
    dim = config.qk_pos_emb_head_dim
    if config.rope_type == "rope":
        if config.rotary_percent < 1.0:
            dim = int(dim * config.rotary_percent)
        inv_freq = 1.0 / (config.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        factor = 1.0
    elif config.rope_type == "yarn":
        inv_freq = yarn_inv_freq(dim, config.rotary_base, config.rotary_scaling_factor,
                                 config.original_max_position_embeddings, config.beta_fast, config.beta_slow)
        factor = yarn_concentration_factor(config.rotary_scaling_factor, config.mscale, config.mscale_all_dim)
    else:
        raise ValueError(f"rope_type must be 'rope' or 'yarn', got {config.rope_type!r}")
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    return emb.cos() * factor, emb.sin() * factor


def apply_mla_rotary(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Megatron's RoPE as MLA applies it (``mla_rotary_interleaved``, ``multi_latent_attention``
    in megatron-core 0.16): the rotated part's even channels, then its odd ones (so channel
    pairs (2i, 2i+1) rotate together), then the non-interleaved rotation; the result keeps that
    even-then-odd order."""
    rot_dim = cos.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t_rot = torch.cat([t_rot[..., 0::2], t_rot[..., 1::2]], dim=-1)
    return apply_rotary(torch.cat([t_rot, t_pass], dim=-1), cos, sin)
