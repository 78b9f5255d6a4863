"""Fake implementations, autograd and Python entry points for the fused ops.

Importing this module requires the compiled extension (``megatron_siamese.ops.load_error()``
says whether it is there); it registers, as pytorch/extension-cpp does:

* ``register_fake`` for every op, so torch.compile and meta tensors know the output shapes;
* ``register_autograd`` for ``dual_norm`` and ``dual_residual``, whose backward calls the
  corresponding ``*_backward`` op.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from megatron_siamese import _C  # noqa: F401  (defines torch.ops.megatron_siamese.*)

ops = torch.ops.megatron_siamese


# -- fake (meta) implementations -----------------------------------------------------------


@torch.library.register_fake("megatron_siamese::dual_norm")
def _dual_norm_fake(streams, hidden, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias, eps, rms,
                    zero_centered_gamma):
    rows = streams.shape[0]
    return (
        streams.new_empty((rows, 2 * hidden)),
        streams.new_empty((rows, hidden)),
        streams.new_empty((rows, 6), dtype=torch.float32),
    )


@torch.library.register_fake("megatron_siamese::dual_norm_backward")
def _dual_norm_backward_fake(grad_base, grad_normed, streams, stats, hidden, *weights_and_flags):
    return torch.empty_like(streams), streams.new_empty((6, hidden), dtype=torch.float32)


@torch.library.register_fake("megatron_siamese::dual_residual")
def _dual_residual_fake(base, out, bias, mask, scale, inv_c):
    return torch.empty_like(base)


@torch.library.register_fake("megatron_siamese::dual_residual_backward")
def _dual_residual_backward_fake(grad, mask, scale, inv_c, has_bias):
    rows, width = grad.shape
    return (
        grad.new_empty((rows, width // 2)),
        grad.new_empty((width // 2,) if has_bias else (0,), dtype=torch.float32),
    )


# -- autograd ------------------------------------------------------------------------------

_WEIGHT_ARGS = ("x_weight", "x_bias", "y_weight", "y_bias", "in_weight", "in_bias")


def _dual_norm_setup(ctx, inputs, output):
    streams, hidden, *weights, eps, rms, zero_centered_gamma = inputs
    _, _, stats = output
    ctx.hidden, ctx.rms, ctx.zero_centered_gamma = hidden, rms, zero_centered_gamma
    ctx.save_for_backward(streams, stats, *weights)


def _dual_norm_backward(ctx, grad_base, grad_normed, _grad_stats):
    streams, stats, *weights = ctx.saved_tensors
    if grad_base is None:
        grad_base = streams.new_zeros((streams.shape[0], 2 * ctx.hidden))
    if grad_normed is None:
        grad_normed = streams.new_zeros((streams.shape[0], ctx.hidden))
    grad_streams, weight_grads = ops.dual_norm_backward(
        grad_base, grad_normed, streams, stats, ctx.hidden, *weights, ctx.rms, ctx.zero_centered_gamma
    )
    grads = [None if w is None else g.to(w.dtype) for w, g in zip(weights, weight_grads)]
    return (grad_streams, None, *grads, None, None, None)


torch.library.register_autograd(
    "megatron_siamese::dual_norm", _dual_norm_backward, setup_context=_dual_norm_setup
)


def _dual_residual_setup(ctx, inputs, output):
    base, out, bias, mask, scale, inv_c = inputs
    ctx.scale, ctx.inv_c = scale, inv_c
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(mask)


def _dual_residual_backward(ctx, grad):
    (mask,) = ctx.saved_tensors
    grad_out, grad_bias = ops.dual_residual_backward(
        grad, mask, ctx.scale, ctx.inv_c, ctx.bias_dtype is not None
    )
    grad_bias = None if ctx.bias_dtype is None else grad_bias.to(ctx.bias_dtype)
    # d(out_packed)/d(base) is the identity: the packed gradient is base's gradient
    return grad, grad_out, grad_bias, None, None, None


torch.library.register_autograd(
    "megatron_siamese::dual_residual", _dual_residual_backward, setup_context=_dual_residual_setup
)


# -- entry points on [..., width] tensors ----------------------------------------------------


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
    """(base = [PostNorm(x) | y], InputNorm(PostNorm(x) + PreNorm(y))) for streams [..., 2h] or [..., h]."""
    leading = streams.shape[:-1]
    base, normed, _ = ops.dual_norm(
        streams.reshape(-1, streams.shape[-1]).contiguous(), hidden, x_weight, x_bias, y_weight,
        y_bias, in_weight, in_bias, eps, rms, zero_centered_gamma,
    )
    return base.view(*leading, 2 * hidden), normed.view(*leading, hidden)


def dual_residual(
    base: Tensor, out: Tensor, bias: Optional[Tensor], mask: Optional[Tensor], scale: float, inv_c: float
) -> Tensor:
    """base + [z / c | z] with z = (out + bias) * mask * scale, for [..., 2h] / [..., h] tensors."""
    leading = out.shape[:-1]
    packed = ops.dual_residual(
        base.reshape(-1, base.shape[-1]).contiguous(),
        out.reshape(-1, out.shape[-1]).contiguous(),
        bias,
        None if mask is None else mask.reshape(-1, mask.shape[-1]).contiguous(),
        scale,
        inv_c,
    )
    return packed.view(*leading, base.shape[-1])
