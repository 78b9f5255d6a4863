"""SiameseTransformerLayer: a Megatron ``TransformerLayer`` that carries two residual streams.

The streams travel packed as one ``[s, b, 2h]`` tensor (``streams.py``), so Megatron's block, recompute, p2p
and CUDA graphs move one tensor. It overrides ``_forward_attention`` / ``_forward_mlp``, the hooks ``forward``,
full recompute and CUDA-graph capture all go through. A HybridModel layer holds one sublayer (the other
IdentityOp). Where the boundary ops run, ``_forward_attention`` hands ``_forward_mlp`` a ``JoinedSublayers``
(Megatron passes it on untouched), except under TE's CUDA graphs, which capture the two hooks apart.
Full story: docs/design.md, "Two streams, one tensor" and "The layer".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import Tensor

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

from megatron_siamese.mlp_call import MLPCallMixin
from megatron_siamese.norms import ChannelScale, QKNormPerConfig, TorchNorm
from megatron_siamese.siamese_sublayer import JoinedSublayers, SiameseSublayerMixin
from megatron_siamese.streams import split_streams
from megatron_siamese.support import UnsupportedConfigError, check_moe_layer, check_supported


@dataclass
class SiameseTransformerLayerSubmodules(TransformerLayerSubmodules):
    """TransformerLayerSubmodules plus the per-sublayer stream norms; ``output_merge`` is built on the last
    global layer only, for specs that cannot give the block a merging final norm (Megatron-LM's ``--spec``)."""

    attn_x_norm: Union[ModuleSpec, type] = IdentityOp  # PostNorm of the X stream
    attn_y_norm: Union[ModuleSpec, type] = IdentityOp  # PreNorm of the Y stream
    mlp_x_norm: Union[ModuleSpec, type] = IdentityOp
    mlp_y_norm: Union[ModuleSpec, type] = IdentityOp
    output_merge: Optional[Union[ModuleSpec, type]] = None


def is_ours(slot, module: type) -> bool:
    """Whether a spec slot (a class or a ModuleSpec) builds ``module``."""
    return getattr(slot, "module", slot) is module


def without_input_norms(submodules: SiameseTransformerLayerSubmodules) -> SiameseTransformerLayerSubmodules:
    """``submodules`` for the ablation without InputNorm; refused where the InputNorm is fused into the first
    linear (TE's Mamba and GDN ``in_proj``), where removing the slot would not remove it."""
    fused = []
    if submodules.self_attention is not IdentityOp and not (
            is_ours(submodules.input_layernorm, TorchNorm) or is_ours(submodules.attn_x_norm, ChannelScale)):
        fused.append("its attention (or mixer) sublayer")
    if submodules.mlp is not IdentityOp and not is_ours(submodules.pre_mlp_layernorm, TorchNorm):
        fused.append("its MLP sublayer")
    if fused:
        raise UnsupportedConfigError(
            f"siamese_input_norm=False (the ablation without InputNorm) cannot remove the InputNorm of {' and '.join(fused)}: "
            "this spec fuses it into the sublayer's first linear. Use a spec whose InputNorms are "
            "megatron_siamese.norms.TorchNorm (the local and Transformer Engine GPT specs, the local hybrid stack), "
            "or leave siamese_input_norm at True.")
    return dataclasses.replace(submodules, input_layernorm=IdentityOp, pre_mlp_layernorm=IdentityOp)


class SiameseTransformerLayer(SiameseSublayerMixin, MLPCallMixin, TransformerLayer):
    """SiameseNorm sublayers (attention, MLP, or both) shared by the X and Y streams."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SiameseTransformerLayerSubmodules,
        layer_number: int = 1,
        built_for: Optional[str] = None,
        mla_submodules: Optional[SiameseTransformerLayerSubmodules] = None,
        **kwargs: Any,
    ):
        if getattr(config, "multi_latent_attention", False) and mla_submodules is not None:
            submodules = mla_submodules  # a spec object made before any config (--spec): its MLA form
        submodules = QKNormPerConfig.resolved(submodules, config)  # the --spec objects' QK-norm
        if not getattr(config, "siamese_input_norm", True):  # the ablation without InputNorm
            submodules = without_input_norms(submodules)
        check_supported(config, submodules, built_for)
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, **kwargs)
        # 0.19 flags a multi-token prediction layer's layer; 0.16 numbers it after the decoder's
        if kwargs.get("is_mtp_layer") or self.layer_number > config.num_layers:
            raise UnsupportedConfigError(
                "SiameseNorm cannot build this layer: it is a multi-token prediction layer's. A SiameseNorm "
                "model's MTP layers are Megatron's stock layers fed the merged decoder output (docs/design.md): "
                "build the MTP block from the stock layer spec (megatron_siamese.specs.get_mtp_block_spec).")

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
        self.has_attention = not isinstance(self.self_attention, IdentityOp)
        self.has_mlp = not isinstance(self.mlp, IdentityOp)
        if not (self.has_attention or self.has_mlp):
            raise ValueError("a SiameseTransformerLayer needs self_attention, mlp or both in its spec")
        if self.has_attention and self.has_mlp:  # a GPT block (a HybridModel's pattern says where MoE goes)
            check_moe_layer(self.config, self.layer_number, self.is_moe_layer)
        stream_norms = ((self.attn_x_norm, self.attn_y_norm) if self.has_attention else ()) + (
            (self.mlp_x_norm, self.mlp_y_norm) if self.has_mlp else ()
        )
        self._init_siamese(stream_norms, sublayers_per_layer=self.has_attention + self.has_mlp)
        # Transformer Engine's CUDA graphs capture _forward_attention and _forward_mlp apart, with
        # static [s, b, 2h] buffers between them: there the sublayers run apart (docs/kernels.md)
        self.may_join_sublayers = (self.has_attention and self.has_mlp
                                   and getattr(self.config, "cuda_graph_impl", "none") != "transformer_engine")
        if not self.may_join_sublayers and self.has_attention and self.has_mlp and self.stream_arithmetic.boundary_requested:
            raise UnsupportedConfigError(
                "siamese_boundary_ops=True (MEGATRON_SIAMESE_BOUNDARY_OPS=1) joins a layer's two sublayers, which "
                "Transformer Engine's CUDA graphs (cuda_graph_impl='transformer_engine') capture apart: leave "
                "siamese_boundary_ops unset (the sublayers then run apart, the same function) or use "
                "cuda_graph_impl='local'.")
        self.is_last_layer = self.layer_number == self.config.num_layers
        self.output_merge = (
            build_norm(submodules.output_merge)
            if submodules.output_merge is not None and self.is_last_layer
            else None
        )

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
        if not self.has_attention:  # a HybridModel MLP layer
            return hidden_states, context
        inference_context = deprecate_inference_params(inference_context, inference_params)

        def attention(normed: Tensor):
            return self.self_attention(
                normed, attention_mask=attention_mask, inference_context=inference_context, **attention_kwargs
            )

        attention_norms = (self.attn_x_norm, self.attn_y_norm, self.input_layernorm)
        if self.may_join_sublayers and self._joins_sublayers(hidden_states):
            mlp_norms = (self.mlp_x_norm, self.mlp_y_norm, self.pre_mlp_layernorm)
            return self._siamese_first_of_two(hidden_states, attention_norms, mlp_norms, attention), context
        return self._siamese_sublayer(hidden_states, *attention_norms, attention), context

    def _forward_mlp(self, hidden_states: Union[Tensor, JoinedSublayers], inference_context=None, padding_mask=None,
                     packed_seq_params=None, **unused: Any):
        """MLP sublayer; returns packed streams, or the merged ``[s, b, h]`` if this layer merges.
        ``hidden_states``: the packed streams, or what ``_forward_attention`` joined to this sublayer."""

        def mlp(normed: Tensor):
            return self._call_mlp(normed, padding_mask, packed_seq_params)

        if isinstance(hidden_states, JoinedSublayers):
            output = self._siamese_second_of_two(hidden_states, mlp)
        elif self.has_mlp:
            output = self._siamese_sublayer(hidden_states, self.mlp_x_norm, self.mlp_y_norm, self.pre_mlp_layernorm, mlp)
        else:
            output = hidden_states  # a HybridModel attention layer
        if self.output_merge is not None:
            output = self.output_merge(*split_streams(output, self.config.hidden_size))
        return make_viewless_tensor(inp=output, requires_grad=output.requires_grad, keep_graph=True)

    # -- Megatron integration --------------------------------------------------------------

    def _get_submodules_under_cudagraphs(self):
        """As the base layer's, plus each captured sublayer's stream norms and the output merge: parameters a
        partial graph reads (the distributed optimizer's ``overlap_param_gather`` waits on them at replay)."""
        submodules = list(super()._get_submodules_under_cudagraphs())
        captured = lambda *modules: any(m is s for m in modules for s in submodules)  # noqa: E731
        ours = []
        if captured(self.input_layernorm, self.self_attention):
            ours += [self.attn_x_norm, self.attn_y_norm]
        if captured(self.pre_mlp_layernorm, self.mlp):
            ours += [self.mlp_x_norm, self.mlp_y_norm] + ([self.output_merge] if self.output_merge is not None else [])
        return submodules + [m for m in ours if not captured(m)]

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
        """As the base layer, but the output merge is saved as one unstacked tensor: it exists on the last layer
        only, and the stacked parameters must stay identical across layers to reshard over TP/PP."""
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
