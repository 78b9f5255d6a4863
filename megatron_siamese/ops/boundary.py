"""Fake implementations, autograd and Python entry points for the boundary ops, which join a
layer's two sublayers (docs/kernels.md, "Boundary ops"):

* ``entry_norm`` / ``hybrid_entry_norm``: the first sublayer's normalized input, no base;
* ``residual_dual_norm``: the first sublayer's residual update and the second's norms;

registered as pytorch/extension-cpp does (``register_fake`` checking what the C++ host layer
checks, ``register_autograd`` with each op's true gradient), and ``layer_entry``: an entry op
whose streams pass through to the boundary op (``_LayerEntry``), so that the boundary op's
gradient of the streams reaches the entry op's backward and is added there.

Imported by ``megatron_siamese.ops.fused``, which re-exports the entry points.
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
    norm_outputs as _norm_outputs,
    ops,
    register_norm_fakes as _register_norm_fakes,
    weight_grads as _own_weight_grads,
)


# -- fake (meta) implementations -----------------------------------------------------------

def _entry_outputs(streams: Tensor, hidden: int):
    """(normed, stats) as both entry ops return them."""
    rows = streams.shape[0]
    return streams.new_empty((rows, hidden)), streams.new_empty((rows, 6), dtype=_accumulation(streams))


def _check_gradient(op: str, name: str, grad: Optional[Tensor], streams: Tensor, shape: Tuple[int, int]) -> None:
    if grad is None:
        return
    torch._check(tuple(grad.shape) == shape, lambda: f"{op}: {name} must be {list(shape)}, got {tuple(grad.shape)}")
    torch._check(grad.device == streams.device, lambda: f"{op}: tensors must be on one device")
    torch._check(grad.dtype == streams.dtype,
                 lambda: f"{op}: {name} ({grad.dtype}) must be in the streams' dtype ({streams.dtype})")


def _check_stats(op: str, stats: Tensor, streams: Tensor, per_row: int) -> None:
    torch._check(tuple(stats.shape) == (streams.shape[0], per_row) and stats.dtype == _accumulation(streams),
                 lambda: f"{op}: stats must be the forward's [rows, {per_row}] statistics")


def _entry_backward_outputs(op: str, grad_through, grad_normed, streams, stats, hidden: int, weight_rows: int):
    _check_streams(streams, hidden, op)
    _check_gradient(op, "grad_streams_through", grad_through, streams, tuple(streams.shape))
    _check_gradient(op, "grad_normed", grad_normed, streams, (streams.shape[0], hidden))
    _check_stats(op, stats, streams, 6)
    return torch.empty_like(streams), streams.new_empty((weight_rows, hidden), dtype=_accumulation(streams))


_register_norm_fakes("entry_norm", _check_norm_call, _entry_outputs, _entry_backward_outputs, 6)
_register_norm_fakes("hybrid_entry_norm", _check_hybrid_norm_call, _entry_outputs, _entry_backward_outputs, 3)


BOUNDARY_STATS = 8  # x's mean and rstd, then dual_norm's six
BOUNDARY_WEIGHT_GRADS = 8  # prev_x_weight, prev_x_bias, then dual_norm's six


def _check_boundary(op: str, streams, out, bias, mask, hidden: int, rms: bool, prev_x_weight, prev_x_bias,
                    **weights) -> None:
    _check_streams(streams, hidden, op)
    rows = streams.shape[0]
    torch._check(tuple(out.shape) == (rows, hidden),
                 lambda: f"{op}: out must be [rows, hidden] = [{rows}, {hidden}], got {tuple(out.shape)}")
    torch._check(out.device == streams.device, lambda: f"{op}: out is not on the streams' device")
    torch._check(out.dtype == streams.dtype,
                 lambda: f"{op}: out ({out.dtype}) must be in the streams' dtype ({streams.dtype})")
    _check_vectors(streams, hidden, op, dict(bias=bias, prev_x_weight=prev_x_weight, prev_x_bias=prev_x_bias))
    if mask is not None:
        torch._check(mask.dtype == torch.bool and tuple(mask.shape) == (rows, hidden),
                     lambda: f"{op}: mask must be bool [rows, hidden]")
    torch._check(prev_x_weight is not None or prev_x_bias is None, lambda: f"{op}: prev_x_bias without prev_x_weight")
    _check_weights(streams, hidden, rms, **weights)


@torch.library.register_fake("megatron_siamese::residual_dual_norm")
def _residual_dual_norm_fake(streams, out, bias, mask, scale, inv_c, hidden, prev_x_weight, prev_x_bias, x_weight,
                             x_bias, y_weight, y_bias, in_weight, in_bias, eps, rms, zero_centered_gamma):
    _check_boundary("residual_dual_norm", streams, out, bias, mask, hidden, rms, prev_x_weight, prev_x_bias,
                    x_weight=x_weight, x_bias=x_bias, y_weight=y_weight, y_bias=y_bias, in_weight=in_weight,
                    in_bias=in_bias)
    base, normed, _ = _norm_outputs(streams, hidden)
    return base, normed, streams.new_empty((streams.shape[0], BOUNDARY_STATS), dtype=_accumulation(streams))


@torch.library.register_fake("megatron_siamese::residual_dual_norm_backward")
def _residual_dual_norm_backward_fake(grad_base, grad_normed, streams, out, bias, mask, stats, scale, inv_c, hidden,
                                      prev_x_weight, prev_x_bias, x_weight, x_bias, y_weight, y_bias, in_weight,
                                      in_bias, rms, zero_centered_gamma):
    op = "residual_dual_norm_backward"
    _check_boundary(op, streams, out, bias, mask, hidden, rms, prev_x_weight, prev_x_bias, x_weight=x_weight,
                    x_bias=x_bias, y_weight=y_weight, y_bias=y_bias, in_weight=in_weight, in_bias=in_bias)
    rows = streams.shape[0]
    _check_gradient(op, "grad_base", grad_base, streams, (rows, 2 * hidden))
    _check_gradient(op, "grad_normed", grad_normed, streams, (rows, hidden))
    _check_stats(op, stats, streams, BOUNDARY_STATS)
    acc = _accumulation(streams)
    return (torch.empty_like(streams), streams.new_empty((rows, hidden)),
            streams.new_empty((hidden if bias is not None else 0,), dtype=acc),
            streams.new_empty((BOUNDARY_WEIGHT_GRADS, hidden), dtype=acc))


# -- autograd ------------------------------------------------------------------------------

# The entry ops alone (their streams do not pass through): the entry op's backward with no
# pass-through gradient. A layer uses ``layer_entry`` below instead.


def _entry_setup(ctx, inputs, output):
    streams, hidden, *weights, eps, rms, zero_centered_gamma = inputs
    _, stats = output
    ctx.hidden, ctx.rms, ctx.zero_centered_gamma = hidden, rms, zero_centered_gamma
    if any(ctx.needs_input_grad[i] for i in (0, *range(2, 2 + len(weights)))):
        ctx.save_for_backward(streams, stats, *weights)


def _entry_backward(backward_op):
    def backward(ctx, grad_normed, _grad_stats):
        streams, stats, *weights = ctx.saved_tensors
        grad_streams, weight_grads = backward_op(
            None, grad_normed, streams, stats, ctx.hidden, *weights, ctx.rms, ctx.zero_centered_gamma)
        return (grad_streams if ctx.needs_input_grad[0] else None, None, *_own_weight_grads(ctx, weights, weight_grads, 2),
                None, None, None)

    return backward


torch.library.register_autograd(
    "megatron_siamese::entry_norm", _entry_backward(ops.entry_norm_backward), setup_context=_entry_setup
)
torch.library.register_autograd(
    "megatron_siamese::hybrid_entry_norm", _entry_backward(ops.hybrid_entry_norm_backward), setup_context=_entry_setup
)

# residual_dual_norm's inputs: streams, out, bias, mask, scale, inv_c, hidden, then 8 weights
# (prev_x_weight, prev_x_bias, dual_norm's six), eps, rms, zero_centered_gamma.
_BOUNDARY_WEIGHTS = 7


def _residual_dual_norm_setup(ctx, inputs, output):
    streams, out, bias, mask, scale, inv_c, hidden, *rest = inputs
    weights, rms, zero_centered_gamma = rest[:-3], rest[-2], rest[-1]  # rest[-3] is eps
    ctx.scale, ctx.inv_c, ctx.hidden, ctx.rms, ctx.zero_centered_gamma = scale, inv_c, hidden, rms, zero_centered_gamma
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(streams, out, bias, mask, output[2], *weights)


def _residual_dual_norm_backward(ctx, grad_base, grad_normed, _grad_stats):
    streams, out, bias, mask, stats, *weights = ctx.saved_tensors
    if grad_normed is None:
        grad_normed = streams.new_zeros((streams.shape[0], ctx.hidden))
    grad_streams, grad_out, grad_bias, weight_grads = ops.residual_dual_norm_backward(
        grad_base, grad_normed, streams, out, bias, mask, stats, ctx.scale, ctx.inv_c, ctx.hidden, *weights,
        ctx.rms, ctx.zero_centered_gamma)
    needs = ctx.needs_input_grad
    return (grad_streams if needs[0] else None, grad_out if needs[1] else None,
            grad_bias.to(ctx.bias_dtype) if needs[2] else None, None, None, None, None,
            *_own_weight_grads(ctx, weights, weight_grads, _BOUNDARY_WEIGHTS), None, None, None)


torch.library.register_autograd(
    "megatron_siamese::residual_dual_norm", _residual_dual_norm_backward, setup_context=_residual_dual_norm_setup
)


class _LayerEntry(torch.autograd.Function):
    """An entry op whose streams pass through: forward returns ``(normed, stats, streams)``, the
    third being the input itself (autograd makes it a view whose grad_fn is this Function), so the
    gradient that the boundary op computes for the streams comes back here and the entry op's
    backward adds it inside (no separate [N, 2h] add of two gradients)."""

    @staticmethod
    def forward(ctx, streams, hidden, hybrid, eps, rms, zero_centered_gamma, *weights):
        op = ops.hybrid_entry_norm if hybrid else ops.entry_norm
        normed, stats = op(streams, hidden, *weights, eps, rms, zero_centered_gamma)
        ctx.hidden, ctx.hybrid, ctx.rms, ctx.zero_centered_gamma = hidden, hybrid, rms, zero_centered_gamma
        ctx.save_for_backward(streams, stats, *weights)
        ctx.mark_non_differentiable(stats)
        return normed, stats, streams

    @staticmethod
    def backward(ctx, grad_normed, _grad_stats, grad_through):
        streams, stats, *weights = ctx.saved_tensors
        op = ops.hybrid_entry_norm_backward if ctx.hybrid else ops.entry_norm_backward
        if grad_normed is None:
            grad_normed = streams.new_zeros((streams.shape[0], ctx.hidden))
        grad_streams, weight_grads = op(grad_through, grad_normed, streams, stats, ctx.hidden, *weights, ctx.rms,
                                        ctx.zero_centered_gamma)
        return (grad_streams, None, None, None, None, None, *_own_weight_grads(ctx, weights, weight_grads, 6))


# -- entry points on [..., width] tensors ----------------------------------------------------


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


def entry_norm(streams: Tensor, hidden: int, x_weight: Tensor, x_bias: Optional[Tensor], y_weight: Tensor,
               y_bias: Optional[Tensor], in_weight: Optional[Tensor], in_bias: Optional[Tensor], eps: float, rms: bool,
               zero_centered_gamma: bool) -> Tensor:
    """``dual_norm``'s normed alone, ``[..., h]``, for streams ``[..., 2h]`` or ``[..., h]``."""
    normed, _ = ops.entry_norm(_rows(streams), hidden, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias, eps,
                               rms, zero_centered_gamma)
    return normed.view(*streams.shape[:-1], hidden)


def hybrid_entry_norm(streams: Tensor, hidden: int, x_scale: Tensor, y_weight: Tensor, y_bias: Optional[Tensor],
                      eps: float, rms: bool, zero_centered_gamma: bool) -> Tensor:
    """``hybrid_dual_norm``'s normed alone, ``[..., h]``."""
    normed, _ = ops.hybrid_entry_norm(_rows(streams), hidden, x_scale, y_weight, y_bias, eps, rms,
                                      zero_centered_gamma)
    return normed.view(*streams.shape[:-1], hidden)


def layer_entry(streams: Tensor, hidden: int, weights: Tuple[Optional[Tensor], ...], eps: float, rms: bool,
                zero_centered_gamma: bool, hybrid: bool = False) -> Tuple[Tensor, Tensor]:
    """A layer's first sublayer: ``(normed [..., h], streams passed through [N, width])``.

    ``weights``: ``entry_norm``'s six (``hybrid_entry_norm``'s three with ``hybrid``). Hand the
    passed-through streams to ``residual_dual_norm``: its gradient of them returns to this op."""
    normed, _, through = _LayerEntry.apply(_rows(streams), hidden, hybrid, eps, rms, zero_centered_gamma, *weights)
    return normed.view(*streams.shape[:-1], hidden), through


def residual_dual_norm(streams: Tensor, out: Tensor, bias: Optional[Tensor], mask: Optional[Tensor], scale: float,
                       inv_c: float, hidden: int, prev_x_weight: Optional[Tensor], prev_x_bias: Optional[Tensor],
                       x_weight: Tensor, x_bias: Optional[Tensor], y_weight: Tensor, y_bias: Optional[Tensor],
                       in_weight: Optional[Tensor], in_bias: Optional[Tensor], eps: float, rms: bool,
                       zero_centered_gamma: bool) -> Tuple[Tensor, Tensor]:
    """``(base [..., 2h], normed [..., h])``: the first sublayer's residual update from the streams
    ``[N, width]`` (rows, as ``layer_entry`` passes them through) and its output ``out [..., h]``,
    then the second sublayer's norms."""
    leading = out.shape[:-1]
    base, normed, _ = ops.residual_dual_norm(
        _rows(streams), _rows(out), bias, None if mask is None else _rows(mask), scale, inv_c, hidden, prev_x_weight,
        prev_x_bias, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias, eps, rms, zero_centered_gamma)
    return base.view(*leading, 2 * hidden), normed.view(*leading, hidden)
