"""The element-wise part of a SiameseNorm sublayer, as a PyTorch composition or fused ops.

Both implementations compute, for packed streams ``[..., 2h]`` (or ``[..., h]`` at the first
layer, where x = y):

    norms:     u = PostNorm(x);  normed = InputNorm(u + PreNorm(y))
    residual:  z = dropout(out + bias);  packed = [u + z / c | y + z]

``norms`` returns an opaque state (what ``residual`` needs) and ``normed``; the state's
tensors can be released and recomputed under selective "layernorm" recompute.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from megatron_siamese.norms import Norm
from megatron_siamese.reference.functional import bias_dropout, residual_update, sublayer_input
from megatron_siamese.streams import pack_streams, split_streams


def _first_layer_or_split(streams: Tensor, hidden: int) -> Tuple[Tensor, Tensor]:
    if streams.shape[-1] == hidden:
        return streams, streams
    return split_streams(streams, hidden)


class TorchSublayer:
    """The PyTorch composition (autograd through torch's fused norm kernels)."""

    def __init__(self, hidden: int):
        self.hidden = hidden

    def norms(self, streams: Tensor, x_norm, y_norm, input_norm) -> Tuple[Tuple[Tensor, ...], Tensor]:
        x, y = _first_layer_or_split(streams, self.hidden)
        u = x_norm(x)
        normed = input_norm(sublayer_input(u, y_norm(y)))
        # the hybrid variant's ChannelScale feeds c1 * x to the sublayer but the X stream
        # continues from x itself, which `residual` takes from the streams (no state: what
        # recompute releases must never alias the input)
        return (() if getattr(x_norm, "residual_is_input", False) else (u,)), normed

    def residual(self, state, streams: Tensor, out: Tensor, bias: Optional[Tensor], dropout: float,
                 training: bool, depth_scale: float) -> Tensor:
        x, y = _first_layer_or_split(streams, self.hidden)
        base = state[0] if state else x
        z = bias_dropout(out, bias, dropout, training)
        return pack_streams(*residual_update(base, y, z, depth_scale))


class FusedSublayer:
    """The extension's ``dual_norm`` and ``dual_residual`` ops (csrc/)."""

    def __init__(self, hidden: int, eps: float, rms: bool, zero_centered: bool):
        from megatron_siamese.ops import fused

        self.ops = fused
        self.hidden = hidden
        self.eps, self.rms, self.zero_centered = eps, rms, zero_centered

    def norms(self, streams: Tensor, x_norm: Norm, y_norm: Norm, input_norm) -> Tuple[Tuple[Tensor, ...], Tensor]:
        fused_input_norm = isinstance(input_norm, Norm)  # else Transformer Engine fuses it downstream
        base, normed = self.ops.dual_norm(
            streams,
            self.hidden,
            x_norm.weight,
            x_norm.bias,
            y_norm.weight,
            y_norm.bias,
            input_norm.weight if fused_input_norm else None,
            input_norm.bias if fused_input_norm else None,
            self.eps,
            self.rms,
            self.zero_centered,
        )
        if not fused_input_norm:
            normed = input_norm(normed)
        return (base,), normed

    def residual(self, state, streams: Tensor, out: Tensor, bias: Optional[Tensor], dropout: float,
                 training: bool, depth_scale: float) -> Tensor:
        (base,) = state
        mask, scale = None, 1.0
        if training and dropout > 0.0:
            mask = torch.empty_like(out, dtype=torch.bool).bernoulli_(1.0 - dropout)
            scale = 1.0 / (1.0 - dropout)
        return self.ops.dual_residual(base, out, bias, mask, scale, 1.0 / depth_scale)


def make_sublayer(config, stream_norms):
    """FusedSublayer when the config asks for it or leaves it to us and it can run; else torch.

    Forcing the fused ops where they cannot run is an error that says why, never a silent
    switch to the PyTorch path.
    """
    from megatron_siamese import ops
    from megatron_siamese.config import FUSED_OPS_ENV, fused_ops_requested
    from megatron_siamese.testing import cpu_harness

    requested = fused_ops_requested(config)
    if requested is False:
        return TorchSublayer(config.hidden_size)
    device = "cuda" if torch.cuda.is_available() and not cpu_harness.is_installed() else "cpu"
    reason = ops.unavailable_reason(device)
    if reason is None and not all(type(norm) is Norm for norm in stream_norms):
        reason = "the layer's stream norms are not megatron_siamese.norms.Norm modules"
    if reason is not None:
        if requested:
            raise RuntimeError(
                f"fused SiameseNorm ops were requested (siamese_fused_ops=True or {FUSED_OPS_ENV}=1) "
                f"but cannot run: {reason}. Set siamese_fused_ops=False (or {FUSED_OPS_ENV}=0) for "
                "the PyTorch path."
            )
        return TorchSublayer(config.hidden_size)
    return FusedSublayer(
        config.hidden_size,
        config.layernorm_epsilon,
        rms=config.normalization == "RMSNorm",
        zero_centered=config.layernorm_zero_centered_gamma,
    )
