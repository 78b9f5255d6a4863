"""What the fused ops' fakes check of their arguments (for ``fused.py`` and ``boundary.py``): the C++
host layer's checks (csrc/ops.cpp), so a wrong call fails at trace time with the kernels' message.
Importing it loads the extension.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
from torch import Tensor

from megatron_siamese import _C  # noqa: F401  (defines torch.ops.megatron_siamese.*)

ops = torch.ops.megatron_siamese

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def accumulation(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def check_streams(streams: Tensor, hidden: int, op: str = "dual_norm") -> None:
    torch._check(streams.dim() >= 1, lambda: f"{op}: streams must be [..., width], got a scalar")
    torch._check(hidden > 0, lambda: f"{op}: hidden must be positive, got {hidden}")
    torch._check(streams.shape[-1] in (hidden, 2 * hidden),
                 lambda: f"{op}: streams width must be hidden (first layer) or 2 * hidden (packed "
                         f"[x | y]); got width {streams.shape[-1]} for hidden {hidden}")
    torch._check(streams.dtype in FLOATS,
                 lambda: f"{op}: streams must be float32, bfloat16, float16 or float64, got {streams.dtype}")


def check_vectors(streams: Tensor, hidden: int, op: str, weights: Dict[str, Optional[Tensor]]) -> None:
    for name, w in weights.items():
        if w is not None:
            torch._check(w.dim() == 1 and w.shape[0] == hidden,
                         lambda: f"{op}: {name} must have shape [{hidden}], got {tuple(w.shape)}")
            torch._check(w.device == streams.device, lambda: f"{op}: {name} is not on the streams' device")
            torch._check(w.dtype in (streams.dtype, torch.float32),
                         lambda: f"{op}: {name} must be in the streams' dtype ({streams.dtype}) or float32, "
                                 f"got {w.dtype}")


def check_weights(streams: Tensor, hidden: int, rms: bool, **weights: Optional[Tensor]) -> None:
    check_vectors(streams, hidden, "dual_norm", weights)
    biased = weights["x_bias"] is not None
    torch._check(biased == (weights["y_bias"] is not None)
                 and (weights["in_weight"] is None or biased == (weights["in_bias"] is not None)),
                 lambda: "dual_norm: give biases for all norms or for none")
    torch._check(not (rms and biased), lambda: "dual_norm: RMSNorm has no bias")
    torch._check(weights["in_weight"] is not None or weights["in_bias"] is None,
                 lambda: "dual_norm: in_bias without in_weight")


def rows(streams: Tensor) -> int:
    """How many rows the streams [..., width] hold."""
    return streams.numel() // streams.shape[-1]


def leading(tensor: Tensor, last: int) -> tuple:
    """``tensor``'s leading shape with ``last`` as its last dimension."""
    return (*tensor.shape[:-1], last)


def statistics(streams: Tensor, per_row: int) -> Tensor:
    return streams.new_empty((rows(streams), per_row), dtype=accumulation(streams))


def norm_outputs(streams: Tensor, hidden: int):
    """(base, normed, stats) as both norm ops return them."""
    return streams.new_empty(leading(streams, 2 * hidden)), streams.new_empty(leading(streams, hidden)), \
        statistics(streams, 6)


def check_hybrid_weights(streams: Tensor, hidden: int, x_scale, y_weight, y_bias, rms: bool) -> None:
    check_vectors(streams, hidden, "hybrid_dual_norm", dict(x_scale=x_scale, y_weight=y_weight, y_bias=y_bias))
    torch._check(not (rms and y_bias is not None), lambda: "hybrid_dual_norm: RMSNorm has no bias")


def check_norm_call(op: str, streams: Tensor, hidden: int, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias,
                    eps: float, rms: bool, zero_centered_gamma: bool) -> None:
    """A call with ``dual_norm``'s arguments (``dual_norm``, ``entry_norm``)."""
    check_streams(streams, hidden, op)
    check_weights(streams, hidden, rms, x_weight=x_weight, x_bias=x_bias, y_weight=y_weight, y_bias=y_bias,
                  in_weight=in_weight, in_bias=in_bias)


def check_hybrid_norm_call(op: str, streams: Tensor, hidden: int, x_scale, y_weight, y_bias, eps: float, rms: bool,
                           zero_centered_gamma: bool) -> None:
    """A call with ``hybrid_dual_norm``'s arguments (``hybrid_dual_norm``, ``hybrid_entry_norm``)."""
    check_streams(streams, hidden, op)
    check_hybrid_weights(streams, hidden, x_scale, y_weight, y_bias, rms)


def register_norm_fakes(op: str, check: Callable, outputs: Callable, backward_outputs: Callable) -> None:
    """The fakes of a norm op with ``dual_norm``'s or ``hybrid_dual_norm``'s arguments and of its
    ``*_backward``; ``outputs`` and ``backward_outputs`` shape their outputs (``weights`` None where absent)."""

    @torch.library.register_fake(f"megatron_siamese::{op}")
    def forward(streams, hidden, *weights_and_flags):
        check(op, streams, hidden, *weights_and_flags)
        return outputs(streams, hidden)

    @torch.library.register_fake(f"megatron_siamese::{op}_backward")
    def backward(grad, grad_normed, streams, stats, hidden, *weights_and_flags):
        return backward_outputs(f"{op}_backward", grad, grad_normed, streams, stats, hidden, weights_and_flags[:-2])


def weight_grad_outputs(weights) -> list:
    """The backward ops' weight gradients: one per weight given, in its dtype."""
    return [torch.empty_like(w) for w in weights if w is not None]
