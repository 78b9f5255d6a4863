"""SiameseTransformerLayer: a Megatron ``TransformerLayer`` that carries two residual streams.

Between layers the streams travel packed as ``[s, b, 2h]`` (X first, Y second, see
``streams.py``), so TransformerBlock, recompute, pipeline p2p and CUDA graphs handle one
tensor. The first global layer receives the embedding ``[s, b, h]`` and starts both
streams from it. The math is ``reference.functional``; this module only wires it into
Megatron's layer structure:

* ``_forward_attention`` / ``_forward_mlp`` are overridden (they are the hooks Megatron's
  full recompute, CUDA-graph capture and ``forward`` all go through), each running one
  SiameseNorm sublayer (``_siamese_sublayer``): the stream norms ``(base, normed)``, the
  shared sublayer, and the dual residual update with one dropout mask, through the fused ops
  or the PyTorch composition (``stream_arithmetic.py``);
* selective recompute "layernorm" discards the stream norms' outputs and recomputes them
  in backward, "mlp" checkpoints the MLP, as the base layer does for its single stream;
* ``c = sqrt(2 * layer_number)`` uses Megatron's global 1-based layer number, so every
  pipeline / virtual-pipeline layout computes the same function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple, Union

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)
from megatron.core.transformer.utils import sharded_state_dict_default
from megatron.core.utils import deprecate_inference_params, make_viewless_tensor

from megatron_siamese.pipeline import require_wide_pipeline_tensors
from megatron_siamese.reference.functional import depth_scale
from megatron_siamese.stream_arithmetic import StreamArithmetic, dropout_mask
from megatron_siamese.streams import split_streams
from megatron_siamese.support import check_supported


@dataclass
class SiameseTransformerLayerSubmodules(TransformerLayerSubmodules):
    """TransformerLayerSubmodules plus the per-sublayer stream norms.

    ``input_layernorm`` / ``pre_mlp_layernorm`` keep their Megatron meaning (InputNorm of
    the attention / MLP sublayer; IdentityOp when Transformer Engine fuses it into the
    following linear). ``output_merge`` is built on the last global layer only, for specs
    that cannot give the block a merging final norm (Megatron-LM's ``--spec``).
    """

    attn_x_norm: Union[ModuleSpec, type] = IdentityOp  # PostNorm of the X stream
    attn_y_norm: Union[ModuleSpec, type] = IdentityOp  # PreNorm of the Y stream
    mlp_x_norm: Union[ModuleSpec, type] = IdentityOp
    mlp_y_norm: Union[ModuleSpec, type] = IdentityOp
    output_merge: Optional[Union[ModuleSpec, type]] = None


class SiameseTransformerLayer(TransformerLayer):
    """One SiameseNorm block: attention and MLP sublayers shared by the X and Y streams."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SiameseTransformerLayerSubmodules,
        layer_number: int = 1,
        **kwargs: Any,
    ):
        check_supported(config, submodules)
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, **kwargs)

        def build_norm(spec):
            return build_module(
                spec,
                config=self.config,
                hidden_size=self.config.hidden_size,
                eps=self.config.layernorm_epsilon,
            )

        self.attn_x_norm = build_norm(submodules.attn_x_norm)
        self.attn_y_norm = build_norm(submodules.attn_y_norm)
        self.mlp_x_norm = build_norm(submodules.mlp_x_norm)
        self.mlp_y_norm = build_norm(submodules.mlp_y_norm)

        self.depth_scale = depth_scale(self.layer_number)
        self.stream_arithmetic = StreamArithmetic(
            self.config, (self.attn_x_norm, self.attn_y_norm, self.mlp_x_norm, self.mlp_y_norm)
        )
        self.is_first_layer = self.layer_number == 1
        self.is_last_layer = self.layer_number == self.config.num_layers
        self.output_merge = (
            build_norm(submodules.output_merge)
            if submodules.output_merge is not None and self.is_last_layer
            else None
        )
        self.recompute_stream_norms = (
            self.config.recompute_granularity == "selective"
            and "layernorm" in self.config.recompute_modules
        )
        require_wide_pipeline_tensors(self.config)

    # -- streams ---------------------------------------------------------------------------

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

    def _siamese_sublayer(self, hidden_states: Tensor, x_norm, y_norm, input_norm,
                          sublayer: Callable[[Tensor], Tuple[Tensor, Optional[Tensor]]]) -> Tensor:
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

    # -- sublayers -------------------------------------------------------------------------

    def _forward_attention(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor] = None,
        context: Optional[Tensor] = None,
        context_mask: Optional[Tensor] = None,
        inference_context: Optional[Any] = None,
        padding_mask: Optional[Tensor] = None,
        *,
        inference_params: Optional[Any] = None,
        **attention_kwargs: Any,
    ):
        """Attention sublayer on packed streams; returns ``(packed [s, b, 2h], context)``."""
        inference_context = deprecate_inference_params(inference_context, inference_params)

        def attention(normed: Tensor):
            return self.self_attention(
                normed, attention_mask=attention_mask, inference_context=inference_context, **attention_kwargs
            )

        packed = self._siamese_sublayer(
            hidden_states, self.attn_x_norm, self.attn_y_norm, self.input_layernorm, attention
        )
        return packed, context

    def _forward_mlp(self, hidden_states: Tensor, inference_context=None, padding_mask=None, **unused: Any):
        """MLP sublayer; returns packed streams, or the merged ``[s, b, h]`` if this layer merges.

        Newer Megatron passes more keywords (``packed_seq_params``, ...) that the MLP does not use.
        """

        def mlp(normed: Tensor):
            if self.recompute_mlp:
                return self._checkpointed_mlp(normed, padding_mask)
            return self.mlp(normed, padding_mask=padding_mask)

        output = self._siamese_sublayer(
            hidden_states, self.mlp_x_norm, self.mlp_y_norm, self.pre_mlp_layernorm, mlp
        )
        if self.output_merge is not None:
            output = self.output_merge(*split_streams(output, self.config.hidden_size))
        return make_viewless_tensor(inp=output, requires_grad=output.requires_grad, keep_graph=True)

    def _checkpointed_mlp(self, normed: Tensor, padding_mask: Optional[Tensor]):
        """Selective "mlp" recompute.

        The MLP's bias (``linear_fc2`` with ``skip_bias_add``) is a Parameter. Returned
        from a checkpoint's autograd Function, that Parameter would itself be given the
        Function as grad_fn, and the backward would recurse into its own checkpoint
        forever; so only the activation crosses the checkpoint and the bias is used
        directly.
        """
        biases = []

        def mlp_activation(inp: Tensor) -> Tensor:
            output, bias = self.mlp(inp, padding_mask=padding_mask)
            if bias is not None and bias.grad_fn is not None:
                raise NotImplementedError(
                    "selective 'mlp' recompute needs the MLP's output bias to be a parameter"
                )
            biases[:] = [bias]
            return output

        if self.config.fp8:
            from megatron.core.extensions.transformer_engine import te_checkpoint

            output = te_checkpoint(
                mlp_activation,
                False,
                tensor_parallel.random.get_cuda_rng_tracker,
                self.pg_collection.tp,
                normed,
            )
        else:
            output = tensor_parallel.checkpoint(mlp_activation, False, normed)
        return output, biases[0]

    # -- Megatron integration --------------------------------------------------------------

    def get_layer_static_inputs(self, seq_length, micro_batch_size):
        """CUDA-graph static inputs: every layer but the first receives packed ``2h`` streams."""
        static_inputs = super().get_layer_static_inputs(seq_length, micro_batch_size)
        hidden_states = static_inputs["hidden_states"]
        if not self.is_first_layer:
            static_inputs["hidden_states"] = torch.ones(
                (*hidden_states.shape[:-1], 2 * self.config.hidden_size),
                dtype=hidden_states.dtype,
                requires_grad=True,
                device=hidden_states.device,
            )
        return static_inputs

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> ShardedStateDict:
        """As the base layer, but the output merge is one tensor, not a slice of a layer stack.

        TransformerBlock stacks every layer parameter along a global layer axis; the merge
        norms exist on the last layer only, so they are saved without that axis and the
        stacked parameters stay identical across layers (checkpoints reshard over TP/PP).
        """
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.output_merge is not None:
            merge_prefix = f"{prefix}output_merge."
            for key in [k for k in sharded if k.startswith(merge_prefix)]:
                del sharded[key]
            sharded.update(
                sharded_state_dict_default(
                    self.output_merge, merge_prefix, (), metadata, tp_group=self.tp_group
                )
            )
        return sharded
