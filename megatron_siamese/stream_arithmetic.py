"""The stream arithmetic around a SiameseNorm sublayer: fused ops or the PyTorch composition.

Both compute the norms and the residual of ``reference.functional`` (``stream_norms``, ``dual_residual``).
``StreamArithmetic`` picks one per device the tensors live on: the fused ops where the extension has kernels for
that device (or always, or never, as the config asks). Where a layer holds two sublayers the fused ops also join
them, so the first sublayer's base and the streams between the sublayers are never written.
docs/design.md, "The layer"; docs/kernels.md, "Boundary ops".
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

import megatron_siamese.ops as ops
from megatron_siamese.config import BOUNDARY_OPS_ENV, FUSED_OPS_ENV, boundary_ops_requested, fused_ops_requested
from megatron_siamese.norms import ChannelScale, TorchNorm
from megatron_siamese.reference.functional import dual_residual, stream_norms


def dropout_mask(out: Tensor, p: float, training: bool) -> Tuple[Optional[Tensor], float]:
    """(keep mask, 1 / (1 - p)) for hidden dropout on ``out``, one mask for both streams; (None, 1.0) when off."""
    if not training or p <= 0.0:
        return None, 1.0
    return torch.empty_like(out, dtype=torch.bool).bernoulli_(1.0 - p), 1.0 / (1.0 - p)


class TorchStreamArithmetic:
    """The PyTorch composition (autograd through torch's norm kernels)."""

    name = "pytorch"

    def __init__(self, hidden: int):
        self.hidden = hidden

    def norms(self, streams: Tensor, x_norm, y_norm, input_norm) -> Tuple[Tensor, Tensor]:
        # the hybrid variant's ChannelScale feeds c1 * x to the sublayer; x itself carries on
        return stream_norms(streams, self.hidden, x_norm, y_norm, input_norm,
                            residual_keeps_x=getattr(x_norm, "residual_is_input", False))

    @staticmethod
    def residual(base: Tensor, out: Tensor, bias: Optional[Tensor], mask: Optional[Tensor], scale: float,
                 inv_c: float) -> Tensor:
        return dual_residual(base, out, bias, mask, scale, inv_c)


class FusedStreamArithmetic:
    """The extension's ``dual_norm`` (``hybrid_dual_norm``) and ``dual_residual`` ops (csrc/)."""

    @staticmethod
    def implements(stream_norms: Sequence[object]) -> bool:
        """Whether the ops compute these (PostNorm, PreNorm) pairs (TorchNorms; ChannelScale on the X side)."""
        x_norms, y_norms = stream_norms[0::2], stream_norms[1::2]
        return all(type(norm) in (TorchNorm, ChannelScale) for norm in x_norms) and all(
            type(norm) is TorchNorm for norm in y_norms
        )

    name = "fused"

    def __init__(self, hidden: int, eps: float, rms: bool, zero_centered: bool):
        from megatron_siamese.ops import fused

        self.ops = fused
        self.hidden = hidden
        self.eps, self.rms, self.zero_centered = eps, rms, zero_centered

    def _input_weights(self, input_norm) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """The InputNorm's weights when the op applies it, else (None, None): ``_finish`` applies the module."""
        return (input_norm.weight, input_norm.bias) if isinstance(input_norm, TorchNorm) else (None, None)

    @staticmethod
    def _finish(normed: Tensor, input_norm) -> Tensor:
        return normed if isinstance(input_norm, TorchNorm) else input_norm(normed)

    def _entry_weights(self, x_norm, y_norm, input_norm) -> Tuple[Optional[Tensor], ...]:
        """dual_norm's six weights, or hybrid_dual_norm's three for a ChannelScale X side."""
        if type(x_norm) is ChannelScale:
            return x_norm.weight, y_norm.weight, y_norm.bias
        return (x_norm.weight, x_norm.bias, y_norm.weight, y_norm.bias, *self._input_weights(input_norm))

    def _flags(self):
        return self.eps, self.rms, self.zero_centered

    def norms(self, streams: Tensor, x_norm: Union[TorchNorm, ChannelScale], y_norm: TorchNorm,
              input_norm) -> Tuple[Tensor, Tensor]:
        op = self.ops.hybrid_dual_norm if type(x_norm) is ChannelScale else self.ops.dual_norm
        base, normed = op(streams, self.hidden, *self._entry_weights(x_norm, y_norm, input_norm), *self._flags())
        return base, self._finish(normed, input_norm)  # the hybrid spec's input norm is IdentityOp

    def residual(self, base: Tensor, out: Tensor, bias: Optional[Tensor], mask: Optional[Tensor], scale: float,
                 inv_c: float) -> Tensor:
        return self.ops.dual_residual(base, out, bias, mask, scale, inv_c)

    # -- a layer's two sublayers joined ------------------------------------------------------

    def entry(self, streams: Tensor, x_norm, y_norm, input_norm) -> Tuple[Tensor, Tensor]:
        """The first sublayer's normalized input, and the streams passed through (rows) for ``boundary``."""
        normed, through = self.ops.layer_entry(streams, self.hidden, self._entry_weights(x_norm, y_norm, input_norm),
                                               *self._flags(), hybrid=type(x_norm) is ChannelScale)
        return self._finish(normed, input_norm), through

    def entry_normed(self, streams: Tensor, x_norm, y_norm, input_norm) -> Tensor:
        """``entry``'s normed again, without autograd (selective recompute refills it)."""
        op = self.ops.hybrid_entry_norm if type(x_norm) is ChannelScale else self.ops.entry_norm
        return op(streams, self.hidden, *self._entry_weights(x_norm, y_norm, input_norm), *self._flags())

    def boundary(self, through: Tensor, out: Tensor, bias: Optional[Tensor], mask: Optional[Tensor], scale: float,
                 inv_c: float, prev_x_norm, x_norm: TorchNorm, y_norm: TorchNorm, input_norm) -> Tuple[Tensor, Tensor]:
        """The second sublayer's ``(base, normed)``: the first's residual update and the second's norms, one op."""
        prev = (None, None) if type(prev_x_norm) is ChannelScale else (prev_x_norm.weight, prev_x_norm.bias)
        base, normed = self.ops.residual_dual_norm(
            through, out, bias, mask, scale, inv_c, self.hidden, *prev, x_norm.weight, x_norm.bias, y_norm.weight,
            y_norm.bias, *self._input_weights(input_norm), *self._flags())
        return base, self._finish(normed, input_norm)


Arithmetic = Union[TorchStreamArithmetic, FusedStreamArithmetic]


class StreamArithmetic:
    """The fused ops where they can run on the tensors' device, else the PyTorch composition
    (``siamese_fused_ops`` True insists, False never uses them). Reasons that hold on every device are
    found at construction; a device without kernels at the first forward there."""

    def __init__(self, config, stream_norms: Sequence[object]):
        """``stream_norms``: the (PostNorm, PreNorm) modules of each sublayer, flat, in pairs."""
        self.requested = fused_ops_requested(config)
        self.torch = TorchStreamArithmetic(config.hidden_size)
        self.fused: Optional[FusedStreamArithmetic] = None
        self.refusal: Optional[str] = None
        if self.requested is not False:
            self.refusal = ops.load_error()
            if self.refusal is None and getattr(config, "enable_autocast", False):
                self.refusal = ("enable_autocast runs the sublayers in autocast's dtype while the streams stay in "
                                "params_dtype, and the fused ops take one dtype for both")
            if self.refusal is None and not FusedStreamArithmetic.implements(stream_norms):
                self.refusal = (
                    "the layer's stream norms are not megatron_siamese.norms.TorchNorm (or, on the X side, "
                    "ChannelScale) modules"
                )
            if self.refusal is None:
                self.fused = FusedStreamArithmetic(
                    config.hidden_size,
                    config.layernorm_epsilon,
                    rms=config.normalization == "RMSNorm",
                    zero_centered=config.layernorm_zero_centered_gamma,
                )
            elif self.requested:
                raise self._forced_error(self.refusal)
        self._by_device: Dict[str, Arithmetic] = {}
        self.boundary_requested = boundary_ops_requested(config)
        self._joins_by_device: Dict[str, bool] = {}

    @staticmethod
    def _forced_error(reason: str) -> RuntimeError:
        return RuntimeError(
            f"fused SiameseNorm ops were requested (siamese_fused_ops=True or {FUSED_OPS_ENV}=1) "
            f"but cannot run: {reason}. Set siamese_fused_ops=False (or {FUSED_OPS_ENV}=0) for "
            "the PyTorch path."
        )

    def on(self, device: torch.device) -> Arithmetic:
        """The implementation for tensors on ``device``."""
        chosen = self._by_device.get(device.type)
        if chosen is None:
            chosen = self.torch
            if self.fused is not None:
                reason = ops.unavailable_reason(device.type)
                if reason is None:
                    chosen = self.fused
                elif self.requested:
                    raise self._forced_error(reason)
            self._by_device[device.type] = chosen
        return chosen

    def describe(self, device: torch.device) -> str:
        """Which arithmetic runs on ``device``, and why not the fused ops where they do not: for a log line."""
        if isinstance(self.on(device), FusedStreamArithmetic):
            kernels = "CUDA" if device.type == "cuda" else "C++"
            return f"the fused {kernels} ops, " + ("joined by the boundary ops" if self.joins(device) else
                                                    "each sublayer's apart (the boundary ops off)")
        why = self.refusal or ops.unavailable_reason(device.type) or "--no-fused-ops given"
        return f"PyTorch's ops, the same function unfused ({why})"

    def joins(self, device: torch.device) -> bool:
        """Whether a layer's two sublayers run joined by the boundary ops on ``device``: where the fused ops run
        and the setting allows. Insisting where the fused ops do not run is an error."""
        joined = self._joins_by_device.get(device.type)
        if joined is None:
            fused = isinstance(self.on(device), FusedStreamArithmetic)
            if self.boundary_requested and not fused:
                raise RuntimeError(
                    f"the boundary ops were requested (siamese_boundary_ops=True or {BOUNDARY_OPS_ENV}=1) but the "
                    f"fused ops do not run here ({self.refusal or 'siamese_fused_ops=False'}). Set "
                    f"siamese_boundary_ops=False (or {BOUNDARY_OPS_ENV}=0), or enable the fused ops.")
            joined = fused and self.boundary_requested is not False
            self._joins_by_device[device.type] = joined
        return joined
