"""The single-stream baselines on Megatron's TransformerLayer: Post-Norm, HybridNorm and Mix-LN.

Megatron-Core has Pre-Norm only. Each baseline is Megatron's own ``TransformerLayer`` whose norms sit where
``reference.functional.norm_placement`` puts them for the layer's global number. Every layer spec carries all
four norm slots and a layer drops those its placement does not name once Megatron has numbered it, so pipeline
stages cut Mix-LN where one rank would; layers then differ in parameters, hence per-layer checkpoint keys. The
hooks are the layer's own, as the SiameseNorm layer's; the stock hooks' extras are refused by name.
Full story: docs/research.md, "The baselines: Post-Norm, HybridNorm, Mix-LN".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.utils import deprecate_inference_params, make_viewless_tensor

from megatron_siamese.mlp_call import MLPCallMixin
from megatron_siamese.norms import TorchNorm
from megatron_siamese.qkv_norm import with_value_norm
from megatron_siamese.reference.functional import (
    MIX_LN_ALPHA,
    SINGLE_STREAM_SCHEMES,
    has_final_norm,
    norm_placement,
)
from megatron_siamese.specs import stock_decoder_layers
from megatron_siamese.support import check_single_stream_supported


@dataclass
class SingleStreamTransformerLayerSubmodules(TransformerLayerSubmodules):
    """TransformerLayerSubmodules plus the norms after each residual add."""

    post_attn_norm: Union[ModuleSpec, type] = IdentityOp
    post_mlp_norm: Union[ModuleSpec, type] = IdentityOp


class SingleStreamTransformerLayer(MLPCallMixin, TransformerLayer):
    """Megatron's TransformerLayer with the norms of ``scheme`` (post, hybridnorm, mixln)."""

    def __init__(self, config: TransformerConfig, submodules: SingleStreamTransformerLayerSubmodules,
                 layer_number: int = 1, scheme: str = "post", **kwargs: Any):
        if scheme not in SINGLE_STREAM_SCHEMES:
            raise ValueError(f"scheme must be one of {SINGLE_STREAM_SCHEMES}, got {scheme!r}")
        check_single_stream_supported(config, scheme)
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, **kwargs)
        self.scheme = scheme
        self.placement = self._placement()

        def norm(spec, present: bool):
            if not present:
                return IdentityOp()
            return build_module(spec, config=self.config, hidden_size=self.config.hidden_size,
                                eps=self.config.layernorm_epsilon)

        # the base class built the input norms from the spec; a placement without them drops them
        if not self.placement.attention_input:
            self.input_layernorm = IdentityOp()
        if not self.placement.mlp_input:
            self.pre_mlp_layernorm = IdentityOp()
        self.post_attn_norm = norm(submodules.post_attn_norm, self.placement.after_attention)
        self.post_mlp_norm = norm(submodules.post_mlp_norm, self.placement.after_mlp)
        self.recompute_input_norms = (self.config.recompute_granularity == "selective"
                                      and "layernorm" in (self.config.recompute_modules or ()))

    def _placement(self):
        """Where this layer's norms sit: by its global number (Megatron's, after the stage offset)."""
        return norm_placement(self.scheme, self.layer_number, self.config.num_layers,
                              getattr(self.config, "mix_ln_alpha", MIX_LN_ALPHA),
                              getattr(self.config, "hybridnorm_star", False))

    def _sublayer(self, hidden_states: Tensor, input_norm, sublayer, bias_dropout_add, output_norm) -> Tensor:
        """``OutputNorm(x + dropout(out + bias))``, ``(out, bias) = sublayer(InputNorm(x))``."""
        checkpoint = None
        if self.recompute_input_norms and not isinstance(input_norm, IdentityOp):
            # CheckpointWithoutOutput treats any fp8 argument but None as "FP8 on": pass config.fp8
            checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=self.config.fp8)
            normed = checkpoint.checkpoint(input_norm, hidden_states)
        else:
            normed = input_norm(hidden_states)
        output_with_bias = sublayer(normed)
        if checkpoint is not None:
            checkpoint.discard_output_and_register_recompute(output_with_bias[0])
        with self.bias_dropout_add_exec_handler():
            hidden_states = bias_dropout_add(self.training, self.config.bias_dropout_fusion)(
                output_with_bias, hidden_states, self.hidden_dropout)
        return output_norm(hidden_states)

    def _forward_attention(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None,
                           context: Optional[Tensor] = None, context_mask: Optional[Tensor] = None,
                           inference_context: Optional[Any] = None, padding_mask: Optional[Tensor] = None, *,
                           inference_params: Optional[Any] = None, **attention_kwargs: Any):
        """The attention sublayer; returns ``(hidden_states, context)`` as the stock hook."""
        inference_context = deprecate_inference_params(inference_context, inference_params)

        def attention(normed: Tensor):
            return self.self_attention(normed, attention_mask=attention_mask, inference_context=inference_context,
                                       **attention_kwargs)

        return self._sublayer(hidden_states, self.input_layernorm, attention, self.self_attn_bda,
                              self.post_attn_norm), context

    def _forward_mlp(self, hidden_states: Tensor, inference_context=None, padding_mask=None,
                     packed_seq_params=None, **unused: Any) -> Tensor:
        """The MLP sublayer (megatron-core >= 0.19 passes keywords a dense MLP does not use)."""
        output = self._sublayer(hidden_states, self.pre_mlp_layernorm,
                                lambda normed: self._call_mlp(normed, padding_mask, packed_seq_params),
                                self.mlp_bda, self.post_mlp_norm)
        return make_viewless_tensor(inp=output, requires_grad=output.requires_grad, keep_graph=True)


def single_stream_layer_from(stock: ModuleSpec, scheme: str) -> ModuleSpec:
    """A stock local layer spec as a ``scheme`` layer: every norm slot ``TorchNorm`` (the layer keeps those of its
    placement), HybridNorm's attention normalizing values too."""
    slots = dict(vars(stock.submodules), input_layernorm=TorchNorm, pre_mlp_layernorm=TorchNorm)
    if scheme == "hybridnorm":
        slots["self_attention"] = with_value_norm(stock.submodules.self_attention)
    submodules = SingleStreamTransformerLayerSubmodules(**slots, post_attn_norm=TorchNorm, post_mlp_norm=TorchNorm)
    return ModuleSpec(module=SingleStreamTransformerLayer, params=dict(stock.params, scheme=scheme),
                      submodules=submodules)


def get_single_stream_block_spec(config: TransformerConfig, vp_stage: Optional[int] = None,
                                 scheme: str = "post") -> TransformerBlockSubmodules:
    """This stage's layers of Megatron's own GPT decoder block for ``config`` as ``scheme`` layers, and a final norm."""
    check_single_stream_supported(config, scheme)  # before Megatron's spec functions see the config
    if scheme == "hybridnorm" and not config.qk_layernorm:
        raise ValueError("HybridNorm normalizes queries and keys: build it with qk_layernorm=True (models.py does)")
    layers = [single_stream_layer_from(stock, scheme) for stock in stock_decoder_layers(config, False, vp_stage=vp_stage)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=TorchNorm if has_final_norm(scheme) else IdentityOp)
