"""Fake implementations and Python entry points for the boundary ops, which join a layer's two
sublayers: ``entry_norm``, ``residual_dual_norm`` and ``layer_entry`` (hybrid variants alike).

``layer_entry`` passes its streams through to the boundary op so that op's stream gradient is added
in its backward; it is a CompositeImplicitAutograd op (returning its input: no fake of its own).
Autograd is C++ (csrc/autograd.cpp). Re-exported by ``ops.fused``. docs/kernels.md, "Boundary ops".
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
    check_vectors as _check_vectors,
    check_weights as _check_weights,
    leading as _leading,
    norm_outputs as _norm_outputs,
    ops,
    register_norm_fakes as _register_norm_fakes,
    rows as _rows,
    statistics as _statistics,
    weight_grad_outputs as _weight_grad_outputs,
)


# -- fake (meta) implementations -----------------------------------------------------------

def _entry_outputs(streams: Tensor, hidden: int):
    """(normed, stats) as both entry ops return them."""
    return streams.new_empty(_leading(streams, hidden)), _statistics(streams, 6)


def _check_gradient(op: str, name: str, grad: Optional[Tensor], streams: Tensor, shape: Tuple[int, ...]) -> None:
    if grad is None:
        return
    torch._check(tuple(grad.shape) == shape,
                 lambda: f"{op}: {name} must be {list(shape)} (the streams' leading shape), got {tuple(grad.shape)}")
    torch._check(grad.device == streams.device, lambda: f"{op}: tensors must be on one device")
    torch._check(grad.dtype == streams.dtype,
                 lambda: f"{op}: {name} ({grad.dtype}) must be in the streams' dtype ({streams.dtype})")


def _check_stats(op: str, stats: Tensor, streams: Tensor, per_row: int) -> None:
    torch._check(tuple(stats.shape) == (_rows(streams), per_row) and stats.dtype == _accumulation(streams),
                 lambda: f"{op}: stats must be the forward's [rows, {per_row}] statistics")


def _entry_backward_outputs(op: str, grad_through, grad_normed, streams, stats, hidden: int, weights):
    _check_streams(streams, hidden, op)
    _check_gradient(op, "grad_streams_through", grad_through, streams, tuple(streams.shape))
    _check_gradient(op, "grad_normed", grad_normed, streams, _leading(streams, hidden))
    _check_stats(op, stats, streams, 6)
    return torch.empty_like(streams), _weight_grad_outputs(weights)


_register_norm_fakes("entry_norm", _check_norm_call, _entry_outputs, _entry_backward_outputs)
_register_norm_fakes("hybrid_entry_norm", _check_hybrid_norm_call, _entry_outputs, _entry_backward_outputs)


BOUNDARY_STATS = 8  # x's mean and rstd, then dual_norm's six


def _check_boundary(op: str, streams, out, bias, mask, hidden: int, rms: bool, prev_x_weight, prev_x_bias,
                    **weights) -> None:
    _check_streams(streams, hidden, op)
    expected = _leading(streams, hidden)
    torch._check(tuple(out.shape) == expected,
                 lambda: f"{op}: out must be the streams' leading shape and hidden wide, {list(expected)}, "
                         f"got {tuple(out.shape)}")
    torch._check(out.device == streams.device, lambda: f"{op}: out is not on the streams' device")
    torch._check(out.dtype == streams.dtype,
                 lambda: f"{op}: out ({out.dtype}) must be in the streams' dtype ({streams.dtype})")
    _check_vectors(streams, hidden, op, dict(bias=bias, prev_x_weight=prev_x_weight, prev_x_bias=prev_x_bias))
    if mask is not None:
        torch._check(mask.dtype == torch.bool and tuple(mask.shape) == expected,
                     lambda: f"{op}: mask must be bool with out's shape")
    torch._check(prev_x_weight is not None or prev_x_bias is None, lambda: f"{op}: prev_x_bias without prev_x_weight")
    _check_weights(streams, hidden, rms, **weights)


@torch.library.register_fake("megatron_siamese::residual_dual_norm")
def _residual_dual_norm_fake(streams, out, bias, mask, scale, inv_c, hidden, prev_x_weight, prev_x_bias, x_weight,
                             x_bias, y_weight, y_bias, in_weight, in_bias, eps, rms, zero_centered_gamma):
    _check_boundary("residual_dual_norm", streams, out, bias, mask, hidden, rms, prev_x_weight, prev_x_bias,
                    x_weight=x_weight, x_bias=x_bias, y_weight=y_weight, y_bias=y_bias, in_weight=in_weight,
                    in_bias=in_bias)
    base, normed, _ = _norm_outputs(streams, hidden)
    return base, normed, _statistics(streams, BOUNDARY_STATS)


@torch.library.register_fake("megatron_siamese::residual_dual_norm_backward")
def _residual_dual_norm_backward_fake(grad_base, grad_normed, streams, out, bias, mask, stats, scale, inv_c, hidden,
                                      prev_x_weight, prev_x_bias, x_weight, x_bias, y_weight, y_bias, in_weight,
                                      in_bias, rms, zero_centered_gamma):
    op = "residual_dual_norm_backward"
    _check_boundary(op, streams, out, bias, mask, hidden, rms, prev_x_weight, prev_x_bias, x_weight=x_weight,
                    x_bias=x_bias, y_weight=y_weight, y_bias=y_bias, in_weight=in_weight, in_bias=in_bias)
    _check_gradient(op, "grad_base", grad_base, streams, _leading(streams, 2 * hidden))
    _check_gradient(op, "grad_normed", grad_normed, streams, _leading(streams, hidden))
    _check_stats(op, stats, streams, BOUNDARY_STATS)
    grad_bias = torch.empty_like(bias) if bias is not None else streams.new_empty((0,), dtype=_accumulation(streams))
    return (torch.empty_like(streams), streams.new_empty(_leading(streams, hidden)), grad_bias,
            _weight_grad_outputs((prev_x_weight, prev_x_bias, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias)))


# -- entry points on [..., width] tensors ----------------------------------------------------


def entry_norm(streams: Tensor, hidden: int, x_weight: Tensor, x_bias: Optional[Tensor], y_weight: Tensor,
               y_bias: Optional[Tensor], in_weight: Optional[Tensor], in_bias: Optional[Tensor], eps: float, rms: bool,
               zero_centered_gamma: bool) -> Tensor:
    """``dual_norm``'s normed alone, ``[..., h]``, for streams ``[..., 2h]`` or ``[..., h]``."""
    return ops.entry_norm(streams.contiguous(), hidden, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias, eps,
                          rms, zero_centered_gamma)[0]


def hybrid_entry_norm(streams: Tensor, hidden: int, x_scale: Tensor, y_weight: Tensor, y_bias: Optional[Tensor],
                      eps: float, rms: bool, zero_centered_gamma: bool) -> Tensor:
    """``hybrid_dual_norm``'s normed alone, ``[..., h]``."""
    return ops.hybrid_entry_norm(streams.contiguous(), hidden, x_scale, y_weight, y_bias, eps, rms,
                                 zero_centered_gamma)[0]


def layer_entry(streams: Tensor, hidden: int, weights: Tuple[Optional[Tensor], ...], eps: float, rms: bool,
                zero_centered_gamma: bool, hybrid: bool = False) -> Tuple[Tensor, Tensor]:
    """A layer's first sublayer: ``(normed [..., h], the streams passed through)``; hand those streams
    to ``residual_dual_norm``, whose gradient of them returns to this op."""
    op = ops.hybrid_layer_entry if hybrid else ops.layer_entry
    return op(streams.contiguous(), hidden, *weights, eps, rms, zero_centered_gamma)


def residual_dual_norm(streams: Tensor, out: Tensor, bias: Optional[Tensor], mask: Optional[Tensor], scale: float,
                       inv_c: float, hidden: int, prev_x_weight: Optional[Tensor], prev_x_bias: Optional[Tensor],
                       x_weight: Tensor, x_bias: Optional[Tensor], y_weight: Tensor, y_bias: Optional[Tensor],
                       in_weight: Optional[Tensor], in_bias: Optional[Tensor], eps: float, rms: bool,
                       zero_centered_gamma: bool) -> Tuple[Tensor, Tensor]:
    """``(base [..., 2h], normed [..., h])``: the first sublayer's residual update of the passed-through
    streams with its output ``out [..., h]``, then the second sublayer's norms."""
    base, normed, _ = ops.residual_dual_norm(
        streams.contiguous(), out, bias, mask, scale, inv_c, hidden, prev_x_weight, prev_x_bias, x_weight, x_bias, y_weight, y_bias,
        in_weight, in_bias, eps, rms, zero_centered_gamma)
    return base, normed
