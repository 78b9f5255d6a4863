"""Fake implementations, autograd and Python entry points for the fused ops.

Importing this module requires the compiled extension (``megatron_siamese.ops.load_error()``
says whether it is there); it registers, as pytorch/extension-cpp does:

* ``register_fake`` for every op, so torch.compile and meta tensors know the output shapes;
* ``register_autograd`` for ``dual_norm``, ``hybrid_dual_norm``, ``dual_residual``, the entry ops
  and ``residual_dual_norm``, whose backward calls the corresponding ``*_backward`` op;

and ``layer_entry``: an entry op whose streams pass through to the layer's boundary op, so
that the boundary op's gradient of the streams reaches the entry op's backward and is added
there (docs/kernels.md, "Boundary ops").
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from megatron_siamese import _C  # noqa: F401  (defines torch.ops.megatron_siamese.*)

ops = torch.ops.megatron_siamese


# -- fake (meta) implementations -----------------------------------------------------------
# They check what the C++ host layer checks (csrc/ops.cpp), so torch.compile and meta
# tensors reject a wrong call at trace time with the same message as the kernels would.

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _accumulation(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_streams(streams: Tensor, hidden: int, op: str = "dual_norm") -> None:
    torch._check(streams.dim() == 2, lambda: f"{op}: streams must be 2-D [rows, width], got {tuple(streams.shape)}")
    torch._check(hidden > 0, lambda: f"{op}: hidden must be positive, got {hidden}")
    torch._check(streams.shape[1] in (hidden, 2 * hidden),
                 lambda: f"{op}: streams width must be hidden (first layer) or 2 * hidden (packed "
                         f"[x | y]); got width {streams.shape[1]} for hidden {hidden}")
    torch._check(streams.dtype in _FLOATS,
                 lambda: f"{op}: streams must be float32, bfloat16, float16 or float64, got {streams.dtype}")


def _check_vectors(streams: Tensor, hidden: int, op: str, weights: Dict[str, Optional[Tensor]]) -> None:
    for name, w in weights.items():
        if w is not None:
            torch._check(w.dim() == 1 and w.shape[0] == hidden,
                         lambda: f"{op}: {name} must have shape [{hidden}], got {tuple(w.shape)}")
            torch._check(w.device == streams.device, lambda: f"{op}: {name} is not on the streams' device")
            torch._check(w.dtype in (streams.dtype, torch.float32),
                         lambda: f"{op}: {name} must be in the streams' dtype ({streams.dtype}) or float32, "
                                 f"got {w.dtype}")


def _check_weights(streams: Tensor, hidden: int, rms: bool, **weights: Optional[Tensor]) -> None:
    _check_vectors(streams, hidden, "dual_norm", weights)
    biased = weights["x_bias"] is not None
    torch._check(biased == (weights["y_bias"] is not None)
                 and (weights["in_weight"] is None or biased == (weights["in_bias"] is not None)),
                 lambda: "dual_norm: give biases for all norms or for none")
    torch._check(not (rms and biased), lambda: "dual_norm: RMSNorm has no bias")
    torch._check(weights["in_weight"] is not None or weights["in_bias"] is None,
                 lambda: "dual_norm: in_bias without in_weight")


def _norm_outputs(streams: Tensor, hidden: int):
    """(base, normed, stats) as both norm ops return them."""
    rows = streams.shape[0]
    return (
        streams.new_empty((rows, 2 * hidden)),
        streams.new_empty((rows, hidden)),
        streams.new_empty((rows, 6), dtype=_accumulation(streams)),
    )


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


@torch.library.register_fake("megatron_siamese::dual_norm")
def _dual_norm_fake(streams, hidden, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias, eps, rms,
                    zero_centered_gamma):
    _check_streams(streams, hidden)
    _check_weights(streams, hidden, rms, x_weight=x_weight, x_bias=x_bias, y_weight=y_weight, y_bias=y_bias,
                   in_weight=in_weight, in_bias=in_bias)
    return _norm_outputs(streams, hidden)


@torch.library.register_fake("megatron_siamese::dual_norm_backward")
def _dual_norm_backward_fake(grad_base, grad_normed, streams, stats, hidden, *weights_and_flags):
    return _norm_backward_outputs("dual_norm_backward", grad_base, grad_normed, streams, stats, hidden, 6)


def _check_hybrid_weights(streams: Tensor, hidden: int, x_scale, y_weight, y_bias, rms: bool) -> None:
    _check_vectors(streams, hidden, "hybrid_dual_norm", dict(x_scale=x_scale, y_weight=y_weight, y_bias=y_bias))
    torch._check(not (rms and y_bias is not None), lambda: "hybrid_dual_norm: RMSNorm has no bias")


@torch.library.register_fake("megatron_siamese::hybrid_dual_norm")
def _hybrid_dual_norm_fake(streams, hidden, x_scale, y_weight, y_bias, eps, rms, zero_centered_gamma):
    _check_streams(streams, hidden, "hybrid_dual_norm")
    _check_hybrid_weights(streams, hidden, x_scale, y_weight, y_bias, rms)
    return _norm_outputs(streams, hidden)


@torch.library.register_fake("megatron_siamese::hybrid_dual_norm_backward")
def _hybrid_dual_norm_backward_fake(grad_base, grad_normed, streams, stats, hidden, *weights_and_flags):
    return _norm_backward_outputs("hybrid_dual_norm_backward", grad_base, grad_normed, streams, stats, hidden, 3)


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


@torch.library.register_fake("megatron_siamese::entry_norm")
def _entry_norm_fake(streams, hidden, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias, eps, rms,
                     zero_centered_gamma):
    _check_streams(streams, hidden, "entry_norm")
    _check_weights(streams, hidden, rms, x_weight=x_weight, x_bias=x_bias, y_weight=y_weight, y_bias=y_bias,
                   in_weight=in_weight, in_bias=in_bias)
    return _entry_outputs(streams, hidden)


@torch.library.register_fake("megatron_siamese::entry_norm_backward")
def _entry_norm_backward_fake(grad_through, grad_normed, streams, stats, hidden, *weights_and_flags):
    return _entry_backward_outputs("entry_norm_backward", grad_through, grad_normed, streams, stats, hidden, 6)


@torch.library.register_fake("megatron_siamese::hybrid_entry_norm")
def _hybrid_entry_norm_fake(streams, hidden, x_scale, y_weight, y_bias, eps, rms, zero_centered_gamma):
    _check_streams(streams, hidden, "hybrid_entry_norm")
    _check_hybrid_weights(streams, hidden, x_scale, y_weight, y_bias, rms)
    return _entry_outputs(streams, hidden)


@torch.library.register_fake("megatron_siamese::hybrid_entry_norm_backward")
def _hybrid_entry_norm_backward_fake(grad_through, grad_normed, streams, stats, hidden, *weights_and_flags):
    return _entry_backward_outputs("hybrid_entry_norm_backward", grad_through, grad_normed, streams, stats, hidden, 3)


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
        grads = [None if w is None or not ctx.needs_input_grad[2 + i] else g.to(w.dtype)
                 for i, (w, g) in enumerate(zip(weights, weight_grads))]
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


# The entry ops alone (their streams do not pass through): the entry op's backward with no
# pass-through gradient. A layer uses ``layer_entry`` below instead.


def _entry_setup(ctx, inputs, output):
    streams, hidden, *weights, eps, rms, zero_centered_gamma = inputs
    _, stats = output
    ctx.hidden, ctx.rms, ctx.zero_centered_gamma = hidden, rms, zero_centered_gamma
    if any(ctx.needs_input_grad[i] for i in (0, *range(2, 2 + len(weights)))):
        ctx.save_for_backward(streams, stats, *weights)


def _weight_grads(ctx, weights, weight_grads, first_input: int):
    return [None if w is None or not ctx.needs_input_grad[first_input + i] else g.to(w.dtype)
            for i, (w, g) in enumerate(zip(weights, weight_grads))]


def _entry_backward(backward_op):
    def backward(ctx, grad_normed, _grad_stats):
        streams, stats, *weights = ctx.saved_tensors
        grad_streams, weight_grads = backward_op(
            None, grad_normed, streams, stats, ctx.hidden, *weights, ctx.rms, ctx.zero_centered_gamma)
        return (grad_streams if ctx.needs_input_grad[0] else None, None, *_weight_grads(ctx, weights, weight_grads, 2),
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
    weights, (_eps, rms, zero_centered_gamma) = rest[:-3], rest[-3:]
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
            *_weight_grads(ctx, weights, weight_grads, _BOUNDARY_WEIGHTS), None, None, None)


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
        grads = [None if w is None or not ctx.needs_input_grad[6 + i] else g.to(w.dtype)
                 for i, (w, g) in enumerate(zip(weights, weight_grads))]
        return (grad_streams, None, None, None, None, None, *grads)


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
