"""One SiameseNorm sublayer on packed streams, shared by every SiameseNorm layer class.

A layer class mixes in ``SiameseSublayerMixin``, calls ``_init_siamese`` after its own ``__init__`` and runs
each sublayer as ``_siamese_sublayer(streams, x_norm, y_norm, input_norm, sublayer)`` (the math:
``reference.functional``). Where the boundary ops run, a GPT block's two sublayers run joined
(``_siamese_first_of_two`` / ``_siamese_second_of_two``). ``c`` comes from the global layer number and the
sublayers a layer holds, so every pipeline layout and a HybridModel stack compute the GPT's function.
docs/design.md, "The layer"; docs/kernels.md, "Boundary ops".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron.core import tensor_parallel

from megatron_siamese.pipeline import require_wide_pipeline_tensors
from megatron_siamese.reference.functional import depth_scale, gpt_equivalent_block
from megatron_siamese.stream_arithmetic import StreamArithmetic, dropout_mask

Sublayer = Callable[[Tensor], Tuple[Tensor, Optional[Tensor]]]


@dataclass
class JoinedSublayers:
    """What a layer's first sublayer hands its second when joined: the second's base and normalized input.
    Not a tensor, so a caller expecting the packed streams (a CUDA graph of one sublayer) fails loudly."""

    base: Tensor
    normed: Tensor
    arithmetic: object
    recompute_normed: Optional[Callable[[], Tensor]] = None


def release_until_backward(tensor: Tensor, recompute: Callable[[], Tensor], hook_tensor: Tensor) -> None:
    """Selective "layernorm" recompute for the boundary ops: frees ``tensor``'s storage now and refills it from
    ``recompute()`` when ``hook_tensor``'s gradient arrives. The fused ops' backward never reads ``tensor``, so no
    autograd is needed; storage-to-storage copy, so no version counter moves under views of ``tensor``."""
    if not (torch.is_grad_enabled() and hook_tensor.requires_grad):
        return
    storage = tensor.untyped_storage()
    size = storage.size()
    storage.resize_(0)

    def refill(grad):
        with torch.no_grad():
            fresh = recompute()
        if fresh.untyped_storage().size() != size or not fresh.is_contiguous():
            raise RuntimeError("selective recompute of the boundary ops produced a differently laid out tensor")
        storage.resize_(size)
        storage.copy_(fresh.untyped_storage())
        return grad

    hook_tensor.register_hook(refill)


class SiameseSublayerMixin:
    """Needs ``self.config``, ``self.layer_number`` (global, 1-based) and ``self.hidden_dropout``."""

    def _init_siamese(self, stream_norms: Sequence[object], sublayers_per_layer: int) -> None:
        """``stream_norms``: the PostNorm/PreNorm modules of the sublayers this layer holds."""
        # c = sqrt(2 b), or 1 in the ablation without depth scaling
        self.depth_scale = depth_scale(gpt_equivalent_block(self.layer_number, sublayers_per_layer),
                                       getattr(self.config, "siamese_depth_scale", True))
        self.stream_arithmetic = StreamArithmetic(self.config, stream_norms)
        self.is_first_layer = self.layer_number == 1
        self.recompute_stream_norms = (
            self.config.recompute_granularity == "selective"
            and "layernorm" in (self.config.recompute_modules or ())
        )
        require_wide_pipeline_tensors(self.config)

    def _check_width(self, hidden_states: Tensor) -> None:
        hidden_size = self.config.hidden_size
        if self.is_first_layer and hidden_states.shape[-1] == hidden_size:
            return  # x = y = embedding output
        if hidden_states.shape[-1] != 2 * hidden_size:
            raise ValueError(
                f"SiameseNorm layer {self.layer_number} expected packed streams [s, b, "
                f"{2 * hidden_size}] but got {tuple(hidden_states.shape)}. If this stage "
                "received it from a previous pipeline stage, the schedule's receive buffer was "
                "hidden_size wide: pass p2p_communicator=SiameseP2PCommunicator(pp_group, "
                "config) or set config.variable_seq_lengths=True."
            )

    def _siamese_sublayer(self, hidden_states: Tensor, x_norm, y_norm, input_norm, sublayer: Sublayer) -> Tensor:
        """One sublayer on packed streams: norms, ``sublayer(normed) -> (out, bias)``, dual residual."""
        self._check_width(hidden_states)
        arithmetic = self.stream_arithmetic.on(hidden_states.device)

        def norms(streams: Tensor):
            return arithmetic.norms(streams, x_norm, y_norm, input_norm)

        norm_checkpoint = None
        if self.recompute_stream_norms:
            # CheckpointWithoutOutput treats any fp8 argument but None as "FP8 on" (and then
            # needs Transformer Engine), so pass config.fp8 itself: None when FP8 is off.
            norm_checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=self.config.fp8)
            base, normed = norm_checkpoint.checkpoint(norms, hidden_states)
        else:
            base, normed = norms(hidden_states)
        output, bias = sublayer(normed)
        mask, scale = dropout_mask(output, self.hidden_dropout, self.training)
        packed = arithmetic.residual(base, output, bias, mask, scale, 1.0 / self.depth_scale)
        if norm_checkpoint is not None:
            # the norms' outputs are recomputed when the sublayer's output gradient arrives;
            # they are dead from here on (the residual update does not save them)
            norm_checkpoint.discard_output_and_register_recompute(output)
        return packed

    def _joins_sublayers(self, hidden_states: Tensor) -> bool:
        """Whether this layer's two sublayers run joined by the boundary ops (its device's choice)."""
        return self.stream_arithmetic.joins(hidden_states.device)

    def _siamese_first_of_two(self, hidden_states: Tensor, first_norms, second_norms,
                              sublayer: Sublayer) -> JoinedSublayers:
        """The first of two joined sublayers: entry op, ``sublayer``, boundary op.
        ``first_norms`` / ``second_norms``: (PostNorm, PreNorm, InputNorm) modules of each sublayer."""
        self._check_width(hidden_states)
        arithmetic = self.stream_arithmetic.on(hidden_states.device)
        normed, through = arithmetic.entry(hidden_states, *first_norms)
        output, bias = sublayer(normed)
        if self.recompute_stream_norms:
            release_until_backward(normed, lambda: arithmetic.entry_normed(hidden_states, *first_norms), output)
        mask, scale = dropout_mask(output, self.hidden_dropout, self.training)
        args = (through, output, bias, mask, scale, 1.0 / self.depth_scale, first_norms[0], *second_norms)
        base, second_normed = arithmetic.boundary(*args)
        recompute = (lambda: arithmetic.boundary(*args)[1]) if self.recompute_stream_norms else None
        return JoinedSublayers(base, second_normed, arithmetic, recompute)

    def _siamese_second_of_two(self, joined: JoinedSublayers, sublayer: Sublayer) -> Tensor:
        """The second of two joined sublayers: ``sublayer``, then the residual update; returns the packed streams."""
        output, bias = sublayer(joined.normed)
        if joined.recompute_normed is not None:
            release_until_backward(joined.normed, joined.recompute_normed, output)
        mask, scale = dropout_mask(output, self.hidden_dropout, self.training)
        return joined.arithmetic.residual(joined.base, output, bias, mask, scale, 1.0 / self.depth_scale)
