"""Fake implementations and Python entry points for the fused ops.

Importing it needs the compiled extension (``ops.load_error()`` says whether it is there). The fakes
give torch.compile and meta tensors the output shapes; autograd is C++ (csrc/autograd.cpp), so the
backward runs no Python. Ops take streams as ``[..., width]``, so nothing is reshaped. The boundary
ops are in ``boundary.py``, re-exported here.
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
    leading as _leading,
    norm_outputs as _norm_outputs,
    ops,
    register_norm_fakes as _register_norm_fakes,
    rows as _rows,
    weight_grad_outputs as _weight_grad_outputs,
)


# -- fake (meta) implementations (their checks: ops/arguments.py) ------------------------------

def _norm_backward_outputs(op: str, grad_base, grad_normed, streams, stats, hidden: int, weights):
    """(grad_streams, the given weights' gradients) after the checks both backward ops make."""
    _check_streams(streams, hidden, op)
    torch._check(tuple(grad_base.shape) == _leading(streams, 2 * hidden),
                 lambda: f"{op}: grad_base must be [..., 2 * hidden] (the streams' leading shape), got "
                         f"{tuple(grad_base.shape)}")
    torch._check(tuple(grad_normed.shape) == _leading(streams, hidden),
                 lambda: f"{op}: grad_normed must be [..., hidden] (the streams' leading shape), got "
                         f"{tuple(grad_normed.shape)}")
    torch._check(tuple(stats.shape) == (_rows(streams), 6) and stats.dtype == _accumulation(streams),
                 lambda: f"{op}: stats must be the forward's [rows, 6] statistics")
    torch._check(grad_base.device == streams.device and grad_normed.device == streams.device,
                 lambda: f"{op}: tensors must be on one device")
    torch._check(grad_base.dtype == streams.dtype and grad_normed.dtype == streams.dtype,
                 lambda: f"{op}: grad_base ({grad_base.dtype}) and grad_normed ({grad_normed.dtype}) "
                         f"must be in the streams' dtype ({streams.dtype})")
    return torch.empty_like(streams), _weight_grad_outputs(weights)


_register_norm_fakes("dual_norm", _check_norm_call, _norm_outputs, _norm_backward_outputs)
_register_norm_fakes("hybrid_dual_norm", _check_hybrid_norm_call, _norm_outputs, _norm_backward_outputs)


@torch.library.register_fake("megatron_siamese::dual_residual")
def _dual_residual_fake(base, out, bias, mask, scale, inv_c):
    torch._check(out.dim() >= 1 and tuple(base.shape) == _leading(out, 2 * out.shape[-1]),
                 lambda: f"dual_residual: base must be [..., 2h] and out [..., h] (one leading shape); got "
                         f"{tuple(base.shape)} and {tuple(out.shape)}")
    torch._check(base.dtype == out.dtype, lambda: "dual_residual: base and out dtypes differ")
    torch._check(base.device == out.device, lambda: "dual_residual: base and out are on different devices")
    if bias is not None:
        torch._check(bias.dim() == 1 and bias.shape[0] == out.shape[-1], lambda: "dual_residual: bias must be [h]")
        torch._check(bias.dtype in (out.dtype, torch.float32),
                     lambda: f"dual_residual: bias must be in out's dtype ({out.dtype}) or float32, got {bias.dtype}")
    if mask is not None:
        torch._check(mask.dtype == torch.bool and mask.shape == out.shape,
                     lambda: "dual_residual: mask must be bool with out's shape")
    return torch.empty_like(base)


@torch.library.register_fake("megatron_siamese::dual_residual_backward")
def _dual_residual_backward_fake(grad, mask, scale, inv_c, bias_dtype):
    torch._check(grad.dim() >= 1 and grad.shape[-1] % 2 == 0,
                 lambda: f"dual_residual_backward: grad must be [..., 2h], got {tuple(grad.shape)}")
    hidden = grad.shape[-1] // 2
    if mask is not None:
        torch._check(mask.dtype == torch.bool and tuple(mask.shape) == _leading(grad, hidden),
                     lambda: "dual_residual_backward: mask must be bool [..., h] (grad's leading shape)")
    return grad.new_empty(_leading(grad, hidden)), grad.new_empty((hidden if bias_dtype is not None else 0,),
                                                                  dtype=bias_dtype or _accumulation(grad))


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
    base, normed, _ = ops.dual_norm(streams.contiguous(), hidden, x_weight, x_bias, y_weight, y_bias, in_weight,
                                    in_bias, eps, rms, zero_centered_gamma)
    return base, normed


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
    base, normed, _ = ops.hybrid_dual_norm(streams.contiguous(), hidden, x_scale, y_weight, y_bias, eps, rms,
                                           zero_centered_gamma)
    return base, normed


def dual_residual(
    base: Tensor, out: Tensor, bias: Optional[Tensor], mask: Optional[Tensor], scale: float, inv_c: float
) -> Tensor:
    """base + [z / c | z] with z = (out + bias) * mask * scale, for [..., 2h] / [..., h] tensors."""
    return ops.dual_residual(base, out, bias, mask, scale, inv_c)



# the boundary ops (their registrations run on import); re-exported for the layer's stream arithmetic
from megatron_siamese.ops.boundary import (  # noqa: E402
    entry_norm,
    hybrid_entry_norm,
    layer_entry,
    residual_dual_norm,
)

__all__ = ["dual_norm", "hybrid_dual_norm", "dual_residual", "entry_norm", "hybrid_entry_norm", "layer_entry",
           "residual_dual_norm"]
