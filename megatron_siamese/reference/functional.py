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

The element-wise work is written as the fused ops split it, with their signatures: ``dual_norm`` /
``dual_residual`` per sublayer, and ``entry_norm`` / ``residual_dual_norm`` where a layer joins its two
sublayers (docs/kernels.md). The ablation (``siamese_input_norm``, ``siamese_depth_scale``) drops InputNorm
and/or sets c = 1.

The single-stream baselines (Post-Norm, HybridNorm, Mix-LN; docs/research.md) place each norm per block
(``norm_placement``):

    x = OutputNorm(x + dropout(Sublayer(InputNorm(x)) + bias))     # either norm may be absent

Norms and the residual update are computed in fp32 (fp64 for double inputs) and cast back once, as
Megatron's fused and Transformer Engine norms do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from megatron_siamese.streams import pack_streams, split_streams

NORMALIZATIONS = ("LayerNorm", "RMSNorm")

NormFn = Callable[[Tensor], Tensor]


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
    compute = _compute_dtype(x)
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


def depth_scale(block_number: int, scaled: bool = True) -> float:
    """c = sqrt(2 L) for the block with global 1-based number L; 1 without depth scaling (the ablation)."""
    if block_number < 1:
        raise ValueError(f"the block number is 1-based and global, got {block_number}")
    return math.sqrt(2.0 * block_number) if scaled else 1.0


def gpt_equivalent_block(layer_number: int, sublayers_per_layer: int) -> int:
    """The 1-based GPT block that global layer ``layer_number`` corresponds to: in a HybridModel stack (one
    sublayer per layer) layers 2b - 1 and 2b form block b, so ``*-*-...`` computes exactly the GPT's c."""
    if sublayers_per_layer not in (1, 2):
        raise ValueError(f"a SiameseNorm layer holds one or two sublayers, got {sublayers_per_layer}")
    return math.ceil(layer_number * sublayers_per_layer / 2)


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)  # fp32, or fp64 for double inputs


def _streams_of(streams: Tensor, hidden: int) -> Tuple[Tensor, Tensor]:
    """(x, y) of packed ``[..., 2h]`` streams, or x = y for the first layer's ``[..., h]``."""
    if streams.shape[-1] == hidden:
        return streams, streams
    return split_streams(streams, hidden)


def stream_norms(
    streams: Tensor,
    hidden: int,
    post_norm: NormFn,
    pre_norm: NormFn,
    input_norm: Optional[NormFn],
    *,
    residual_keeps_x: bool = False,
) -> Tuple[Tensor, Tensor]:
    """A sublayer's norm half over any norm callables: ``(base = [u | y], normed = InputNorm(u + PreNorm(y)))``,
    ``u = PostNorm(x)``. ``residual_keeps_x``: the hybrid attention side (``post_norm`` is c1, base is ``[x | y]``)."""
    x, y = _streams_of(streams, hidden)
    u = post_norm(x)
    a = u + pre_norm(y)
    normed = a if input_norm is None else input_norm(a)
    return pack_streams(x if residual_keeps_x else u, y), normed


def _norm_fn(weight: Tensor, bias: Optional[Tensor], eps: float, rms: bool, zero_centered_gamma: bool) -> NormFn:
    kind = "RMSNorm" if rms else "LayerNorm"
    return lambda t: normalize(t, weight, bias, normalization=kind, eps=eps, zero_centered_gamma=zero_centered_gamma)


def dual_norm(
    streams: Tensor,
    hidden: int,
    x_weight: Tensor,
    x_bias: Optional[Tensor],
    y_weight: Tensor,
    y_bias: Optional[Tensor],
    in_weight: Optional[Tensor],
    in_bias: Optional[Tensor],
    eps: float,
    rms: bool,
    zero_centered_gamma: bool,
) -> Tuple[Tensor, Tensor]:
    """Reference of ``ops.dual_norm``: ``(base = [PostNorm(x) | y], InputNorm(PostNorm(x) + PreNorm(y)))``
    for streams ``[..., 2h]`` (or ``[..., h]``: x = y); without ``in_weight`` no InputNorm."""
    input_norm = None if in_weight is None else _norm_fn(in_weight, in_bias, eps, rms, zero_centered_gamma)
    return stream_norms(
        streams,
        hidden,
        _norm_fn(x_weight, x_bias, eps, rms, zero_centered_gamma),
        _norm_fn(y_weight, y_bias, eps, rms, zero_centered_gamma),
        input_norm,
    )


def channel_scale(x: Tensor, scale: Tensor) -> Tensor:
    """c1 * x: the hybrid variant's X-side attention input (the residual keeps x itself)."""
    return x * scale


def hybrid_dual_norm(
    streams: Tensor,
    hidden: int,
    x_scale: Tensor,
    y_weight: Tensor,
    y_bias: Optional[Tensor],
    eps: float,
    rms: bool,
    zero_centered_gamma: bool,
) -> Tuple[Tensor, Tensor]:
    """The hybrid variant's attention side: ``(base = [x | y], c1 * x + PreNorm(y))``, no InputNorm."""
    return stream_norms(
        streams,
        hidden,
        lambda x: channel_scale(x, x_scale),
        _norm_fn(y_weight, y_bias, eps, rms, zero_centered_gamma),
        None,
        residual_keeps_x=True,
    )


def dual_residual(
    base: Tensor, out: Tensor, bias: Optional[Tensor], mask: Optional[Tensor], scale: float, inv_c: float
) -> Tensor:
    """Reference of ``ops.dual_residual``: ``base + [z / c | z]`` with ``z = (out + bias) * mask * scale``
    (no mask: no dropout), for ``base [..., 2h]`` and ``out [..., h]``."""
    compute = _compute_dtype(out)
    z = out.to(compute)
    if bias is not None:
        z = z + bias.to(compute)
    if mask is not None:
        z = z * mask * scale
    u, y = split_streams(base, out.shape[-1])
    return pack_streams((u.to(compute) + z * inv_c).to(base.dtype), (y.to(compute) + z).to(base.dtype))


def entry_norm(streams: Tensor, hidden: int, *weights_and_flags) -> Tensor:
    """Reference of ``ops.entry_norm``: ``dual_norm``'s ``normed`` alone (``residual_dual_norm`` recomputes base)."""
    return dual_norm(streams, hidden, *weights_and_flags)[1]


def hybrid_entry_norm(streams: Tensor, hidden: int, *weights_and_flags) -> Tensor:
    """Reference of ``ops.hybrid_entry_norm``: ``hybrid_dual_norm``'s ``normed`` alone."""
    return hybrid_dual_norm(streams, hidden, *weights_and_flags)[1]


def residual_dual_norm(
    streams: Tensor,
    out: Tensor,
    bias: Optional[Tensor],
    mask: Optional[Tensor],
    scale: float,
    inv_c: float,
    hidden: int,
    prev_x_weight: Optional[Tensor],
    prev_x_bias: Optional[Tensor],
    *norm_args,
) -> Tuple[Tensor, Tensor]:
    """Reference of ``ops.residual_dual_norm``: ``dual_norm(dual_residual([PostNorm_prev(x) | y], out, ...))``
    (``[x | y]`` without ``prev_x_weight``), ``norm_args`` as ``dual_norm``'s; rounded only as outputs."""
    compute = _compute_dtype(streams)
    x, y = _streams_of(streams.to(compute), hidden)
    u = x if prev_x_weight is None else _norm_fn(prev_x_weight, prev_x_bias, *norm_args[-3:])(x)
    updated = dual_residual(pack_streams(u, y), out.to(compute), bias, mask, scale, inv_c)
    base, normed = dual_norm(updated, hidden, *norm_args)
    return base.to(streams.dtype), normed.to(streams.dtype)


def merge_streams(x_normed: Tensor, y_normed: Tensor) -> Tensor:
    """NormX(x) + NormY(y): what FinalNorm receives after the last layer."""
    return x_normed + y_normed


# -- the single-stream baselines ----------------------------------------------------------

SINGLE_STREAM_SCHEMES = ("post", "hybridnorm", "mixln")
MIX_LN_ALPHA = 0.25  # the Mix-LN paper's share of Post-Norm blocks


@dataclass(frozen=True)
class NormPlacement:
    """Which norms a single-stream block has: before a sublayer (``*_input``) or after its residual add
    (``after_*``: the stream itself is normalized)."""

    attention_input: bool
    after_attention: bool
    mlp_input: bool
    after_mlp: bool


PRE_NORM = NormPlacement(attention_input=True, after_attention=False, mlp_input=True, after_mlp=False)
POST_NORM = NormPlacement(attention_input=False, after_attention=True, mlp_input=False, after_mlp=True)
# Norm(x) after the attention's residual add is what HybridNorm's FFN sees and adds to
HYBRID_NORM = NormPlacement(attention_input=False, after_attention=True, mlp_input=False, after_mlp=False)


def mix_ln_post_layers(num_layers: int, alpha: float) -> int:
    """How many of the first blocks Mix-LN makes Post-Norm: floor(alpha L), alpha in [0, 1]
    (the product rounded to 9 decimals first, so that 0.3 * 10 is 3, not 2.9999...)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"the Mix-LN share alpha must lie in [0, 1], got {alpha}")
    return math.floor(round(alpha * num_layers, 9))


def norm_placement(scheme: str, layer_number: int, num_layers: int, mix_ln_alpha: float = MIX_LN_ALPHA,
                   hybridnorm_star: bool = False) -> NormPlacement:
    """The norms of the block with global 1-based number ``layer_number`` of ``num_layers`` under
    ``scheme`` (one of SINGLE_STREAM_SCHEMES)."""
    if not 1 <= layer_number <= num_layers:
        raise ValueError(f"the layer number is 1-based and global, in 1..{num_layers}; got {layer_number}")
    if scheme == "post":
        return POST_NORM
    if scheme == "hybridnorm":
        return PRE_NORM if hybridnorm_star and layer_number == 1 else HYBRID_NORM
    if scheme == "mixln":
        return POST_NORM if layer_number <= mix_ln_post_layers(num_layers, mix_ln_alpha) else PRE_NORM
    raise ValueError(f"scheme must be one of {SINGLE_STREAM_SCHEMES}, got {scheme!r}")


def has_final_norm(scheme: str) -> bool:
    """Whether the block ends in a final norm: not Post-Norm's, whose stream is normalized already."""
    if scheme not in SINGLE_STREAM_SCHEMES:
        raise ValueError(f"scheme must be one of {SINGLE_STREAM_SCHEMES}, got {scheme!r}")
    return scheme != "post"


def single_stream_sublayer(x: Tensor, input_norm: Optional[NormFn], sublayer, output_norm: Optional[NormFn],
                           dropout: Callable[[Tensor], Tensor] = lambda t: t) -> Tensor:
    """``OutputNorm(x + dropout(out + bias))`` with ``(out, bias) = sublayer(InputNorm(x))``; an
    absent norm (None) is the identity."""
    out, bias = sublayer(x if input_norm is None else input_norm(x))
    z = out if bias is None else out + bias
    x = x + dropout(z)
    return x if output_norm is None else output_norm(x)
