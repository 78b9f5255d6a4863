"""SiameseNorm's math in plain PyTorch: the oracle every layer and kernel is tested against.

Two residual streams share every sublayer's weights. For sublayer k of the block with
global 1-based layer number L (Megatron's ``layer_number``), c = sqrt(2 L):

    u = PostNorm_k(x)                           # X stream (Post-Norm-like), normalized
    a = u + PreNorm_k(y)                        # Y stream (Pre-Norm-like) joins it
    z = dropout(Sublayer_k(InputNorm_k(a)) + bias)  # one dropout mask for both streams
    x = u + z / c
    y = y + z

with x = y = embedding output before the first layer and
out = FinalNorm(NormX(x) + NormY(y)) after the last one.

The hybrid variant (the authors' OLMo code) builds the attention sublayer's X side like
HybridNorm: no PostNorm and no InputNorm there, a learnable per-channel scale c1 (ones at
init) on x instead, and QK-norm inside attention:

    z = dropout(Attention_QKNorm(c1 * x + PreNorm_attn(y)) + bias)
    x = x + z / c;  y = y + z

and its MLP sublayer is the standard one above (PostNorm before the MLP).

Norms are computed in fp32 (fp64 for double inputs) and cast back to the input dtype, as
Megatron's fused and Transformer Engine norms do.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def normalize(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    *,
    normalization: str,
    eps: float,
    zero_centered_gamma: bool = False,
) -> Tensor:
    """LayerNorm or RMSNorm over the last dimension; gamma is ``1 + weight`` when zero-centred."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    compute = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for double inputs
    x32 = x.to(compute)
    gamma = weight.to(compute) + 1.0 if zero_centered_gamma else weight.to(compute)
    if normalization == "LayerNorm":
        mean = x32.mean(dim=-1, keepdim=True)
        centered = x32 - mean
        var = centered.pow(2).mean(dim=-1, keepdim=True)
        out = centered * torch.rsqrt(var + eps) * gamma
        if bias is not None:
            out = out + bias.to(compute)
    else:
        if bias is not None:
            raise ValueError("RMSNorm has no bias")
        out = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps) * gamma
    return out.to(x.dtype)


def depth_scale(layer_number: int) -> float:
    """c = sqrt(2 L) for the block with global 1-based layer number L."""
    if layer_number < 1:
        raise ValueError(f"layer_number is 1-based and global, got {layer_number}")
    return math.sqrt(2.0 * layer_number)


def sublayer_input(x_normed: Tensor, y_normed: Tensor) -> Tensor:
    """a = PostNorm(x) + PreNorm(y): what the sublayer's InputNorm receives."""
    return x_normed + y_normed


def bias_dropout(out: Tensor, bias: Optional[Tensor], p: float, training: bool) -> Tensor:
    """z = dropout(out + bias), Megatron's bias-dropout semantics without the add."""
    if bias is not None:
        out = out + bias
    return F.dropout(out, p=p, training=training) if p > 0.0 else out


def residual_update(u: Tensor, y: Tensor, z: Tensor, c: float) -> Tuple[Tensor, Tensor]:
    """x' = u + z / c (depth-scaled, X stream), y' = y + z (identity, Y stream)."""
    return u + z / c, y + z


def channel_scale(x: Tensor, scale: Tensor) -> Tensor:
    """c1 * x: the hybrid variant's X-side attention input (the residual keeps x itself)."""
    return x * scale


def merge_streams(x_normed: Tensor, y_normed: Tensor) -> Tensor:
    """NormX(x) + NormY(y): what FinalNorm receives after the last layer."""
    return x_normed + y_normed
