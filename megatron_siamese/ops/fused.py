"""Fake implementations, autograd and Python entry points for the fused ops.

Importing this module requires the compiled extension (``megatron_siamese.ops.load_error()``
says whether it is there); it registers, as pytorch/extension-cpp does:

* ``register_fake`` for every op, so torch.compile and meta tensors know the output shapes;
* ``register_autograd`` for ``dual_norm``, ``hybrid_dual_norm`` and ``dual_residual``, whose
  backward calls the corresponding ``*_backward`` op.

The boundary ops' registrations and entry points (``entry_norm``, ``hybrid_entry_norm``,
``residual_dual_norm``, ``layer_entry``) are in ``boundary.py``, imported and re-exported here.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from megatron_siamese.ops.arguments import (
    accumulation as _accumulation,
    check_hybrid_norm_call as _check_hybrid_norm_call,
    check_norm_call as _check_norm_call,
    check_streams as _check_streams,
    norm_outputs as _norm_outputs,
    ops,
    register_norm_fakes as _register_norm_fakes,
    weight_grads as _own_weight_grads,
)


# -- fake (meta) implementations -----------------------------------------------------------
# They check what the C++ host layer checks (csrc/ops.cpp, ops/arguments.py), so torch.compile
# and meta tensors reject a wrong call at trace time with the same message as the kernels would.

def _norm_backward_outputs(op: str, grad_base, grad_normed, streams, stats, hidden: int, weight_rows: int):
    """(grad_streams, weight_grads [weight_rows, h]) after the checks both backward ops make."""
    _check_streams(streams, hidden, op)
    rows = streams.shape[0]
    torch._check(tuple(grad_base.shape) == (rows, 2 * hidden),
                 lambda: f"{op}: grad_base must be [rows, 2 * hidden], got {tuple(grad_base.shape)}")
    torch._check(tuple(grad_normed.shape) == (rows, hidden),
                 lambda: f"{op}: grad_normed must be [rows, hidden], got {tuple(grad_normed.shape)}")
    torch._check(tuple(stats.shape) == (rows, 6) and stats.dtype == _accumulation(streams),
                 lambda: f"{op}: stats must be the forward's [rows, 6] statistics")
    torch._check(grad_base.device == streams.device and grad_normed.device == streams.device,
                 lambda: f"{op}: tensors must be on one device")
    torch._check(grad_base.dtype == streams.dtype and grad_normed.dtype == streams.dtype,
                 lambda: f"{op}: grad_base ({grad_base.dtype}) and grad_normed ({grad_normed.dtype}) "
                         f"must be in the streams' dtype ({streams.dtype})")
    return torch.empty_like(streams), streams.new_empty((weight_rows, hidden), dtype=_accumulation(streams))


_register_norm_fakes("dual_norm", _check_norm_call, _norm_outputs, _norm_backward_outputs, 6)
_register_norm_fakes("hybrid_dual_norm", _check_hybrid_norm_call, _norm_outputs, _norm_backward_outputs, 3)


@torch.library.register_fake("megatron_siamese::dual_residual")
def _dual_residual_fake(base, out, bias, mask, scale, inv_c):
    torch._check(out.dim() == 2 and base.dim() == 2 and base.shape[0] == out.shape[0]
                 and base.shape[1] == 2 * out.shape[1],
                 lambda: f"dual_residual: base must be [rows, 2h] and out [rows, h]; got {tuple(base.shape)} "
                         f"and {tuple(out.shape)}")
    torch._check(base.dtype == out.dtype, lambda: "dual_residual: base and out dtypes differ")
    torch._check(base.device == out.device, lambda: "dual_residual: base and out are on different devices")
    if bias is not None:
        torch._check(bias.dim() == 1 and bias.shape[0] == out.shape[1], lambda: "dual_residual: bias must be [h]")
        torch._check(bias.dtype in (out.dtype, torch.float32),
                     lambda: f"dual_residual: bias must be in out's dtype ({out.dtype}) or float32, got {bias.dtype}")
    if mask is not None:
        torch._check(mask.dtype == torch.bool and mask.shape == out.shape,
                     lambda: "dual_residual: mask must be bool with out's shape")
    return torch.empty_like(base)


@torch.library.register_fake("megatron_siamese::dual_residual_backward")
def _dual_residual_backward_fake(grad, mask, scale, inv_c, has_bias):
    torch._check(grad.dim() == 2 and grad.shape[1] % 2 == 0,
                 lambda: f"dual_residual_backward: grad must be [rows, 2h], got {tuple(grad.shape)}")
    rows, width = grad.shape
    if mask is not None:
        torch._check(mask.dtype == torch.bool and tuple(mask.shape) == (rows, width // 2),
                     lambda: "dual_residual_backward: mask must be bool [rows, h]")
    return (
        grad.new_empty((rows, width // 2)),
        grad.new_empty((width // 2,) if has_bias else (0,), dtype=_accumulation(grad)),
    )


# -- autograd ------------------------------------------------------------------------------
# Each setup saves only what the backward needs for the inputs that ask for a gradient.


# dual_norm and hybrid_dual_norm share one shape of signature, (streams, hidden, *weights,
# eps, rms, zero_centered_gamma), and their backward ops return one weight-gradient row per
# weight in that order: one setup and one backward serve both.


def _norm_setup(ctx, inputs, output):
    streams, hidden, *weights, eps, rms, zero_centered_gamma = inputs
    _, _, stats = output
    ctx.hidden, ctx.rms, ctx.zero_centered_gamma = hidden, rms, zero_centered_gamma
    # one kernel computes every gradient, so any gradient asked for needs all of these
    if any(ctx.needs_input_grad[i] for i in (0, *range(2, 2 + len(weights)))):
        ctx.save_for_backward(streams, stats, *weights)


def _norm_backward(backward_op):
    def backward(ctx, grad_base, grad_normed, _grad_stats):
        streams, stats, *weights = ctx.saved_tensors
        if grad_base is None:
            grad_base = streams.new_zeros((streams.shape[0], 2 * ctx.hidden))
        if grad_normed is None:
            grad_normed = streams.new_zeros((streams.shape[0], ctx.hidden))
        grad_streams, weight_grads = backward_op(
            grad_base, grad_normed, streams, stats, ctx.hidden, *weights, ctx.rms, ctx.zero_centered_gamma
        )
        grads = _own_weight_grads(ctx, weights, weight_grads, 2)
        return (grad_streams if ctx.needs_input_grad[0] else None, None, *grads, None, None, None)

    return backward


torch.library.register_autograd(
    "megatron_siamese::dual_norm", _norm_backward(ops.dual_norm_backward), setup_context=_norm_setup
)
torch.library.register_autograd(
    "megatron_siamese::hybrid_dual_norm", _norm_backward(ops.hybrid_dual_norm_backward), setup_context=_norm_setup
)


def _dual_residual_setup(ctx, inputs, output):
    base, out, bias, mask, scale, inv_c = inputs
    ctx.scale, ctx.inv_c = scale, inv_c
    ctx.bias_dtype = None if bias is None else bias.dtype
    # the mask shapes the gradients of out and bias; base's gradient is the incoming one
    ctx.save_for_backward(mask if (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]) else None)


def _dual_residual_backward(ctx, grad):
    grad_out = grad_bias = None
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        (mask,) = ctx.saved_tensors
        grad_out, grad_bias = ops.dual_residual_backward(
            grad, mask, ctx.scale, ctx.inv_c, ctx.bias_dtype is not None
        )
        grad_bias = grad_bias.to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        grad_out = grad_out if ctx.needs_input_grad[1] else None
    # d(out_packed)/d(base) is the identity: the packed gradient is base's gradient
    return grad if ctx.needs_input_grad[0] else None, grad_out, grad_bias, None, None, None


torch.library.register_autograd(
    "megatron_siamese::dual_residual", _dual_residual_backward, setup_context=_dual_residual_setup
)


# -- entry points on [..., width] tensors ----------------------------------------------------


def _norm_rows(op, streams: Tensor, hidden: int, *weights_and_flags) -> Tuple[Tensor, Tensor]:
    """A norm op on streams [..., width] as rows [N, width]: (base [..., 2h], normed [..., h])."""
    leading = streams.shape[:-1]
    base, normed, _ = op(streams.reshape(-1, streams.shape[-1]).contiguous(), hidden, *weights_and_flags)
    return base.view(*leading, 2 * hidden), normed.view(*leading, hidden)


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
    return _norm_rows(ops.dual_norm, streams, hidden, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias, eps,
                      rms, zero_centered_gamma)


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
    """(base = [x | y], c1 * x + PreNorm(y)) for streams [..., 2h] or [..., h]: the hybrid
    variant's attention side (``x_scale`` is c1; no InputNorm)."""
    return _norm_rows(ops.hybrid_dual_norm, streams, hidden, x_scale, y_weight, y_bias, eps, rms, zero_centered_gamma)


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



# the boundary ops (their registrations run on import); re-exported for the layer's stream arithmetic
from megatron_siamese.ops.boundary import (  # noqa: E402
    entry_norm,
    hybrid_entry_norm,
    layer_entry,
    residual_dual_norm,
)

__all__ = ["dual_norm", "hybrid_dual_norm", "dual_residual", "entry_norm", "hybrid_entry_norm", "layer_entry",
           "residual_dual_norm"]
