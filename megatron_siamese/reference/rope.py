"""Megatron's non-interleaved rotary position embedding (RoPE), for the reference's attention."""

from __future__ import annotations

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
