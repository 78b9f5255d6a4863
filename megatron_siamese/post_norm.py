"""The Post-Norm baseline on Megatron's stock TransformerLayer.

Megatron-Core has Pre-Norm only. Post-Norm (the original Transformer's
``x = Norm(x + Sublayer(x))``) is Megatron's own ``TransformerLayer`` with its input norms
set to identity and a norm applied to the residual stream after each bias-dropout-add; the
stream leaving the last layer is already normalized, so the block's final norm is identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.utils import make_viewless_tensor

from megatron_siamese.norms import TorchNorm
from megatron_siamese.specs import stock_decoder_layers


@dataclass
class PostNormTransformerLayerSubmodules(TransformerLayerSubmodules):
    post_attn_norm: Union[ModuleSpec, type] = IdentityOp
    post_mlp_norm: Union[ModuleSpec, type] = IdentityOp


class PostNormTransformerLayer(TransformerLayer):
    """Megatron's TransformerLayer with each sublayer's norm after its residual add."""

    def __init__(self, config: TransformerConfig, submodules: PostNormTransformerLayerSubmodules, **kwargs):
        super().__init__(config=config, submodules=submodules, **kwargs)
        norm_kwargs = dict(config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)
        self.post_attn_norm = build_module(submodules.post_attn_norm, **norm_kwargs)
        self.post_mlp_norm = build_module(submodules.post_mlp_norm, **norm_kwargs)

    def _forward_attention(self, *args, **kwargs):
        hidden_states, context = super()._forward_attention(*args, **kwargs)
        return self.post_attn_norm(hidden_states), context

    def _forward_mlp(self, hidden_states, *args, **kwargs):
        output = self.post_mlp_norm(super()._forward_mlp(hidden_states, *args, **kwargs))
        return make_viewless_tensor(inp=output, requires_grad=output.requires_grad, keep_graph=True)


def post_norm_layer_from(stock: ModuleSpec) -> ModuleSpec:
    """A stock local layer spec (dense or MoE, any QK-norm) as a Post-Norm layer."""
    submodules = PostNormTransformerLayerSubmodules(
        **{**vars(stock.submodules), "input_layernorm": IdentityOp, "pre_mlp_layernorm": IdentityOp},
        post_attn_norm=TorchNorm,
        post_mlp_norm=TorchNorm,
    )
    return ModuleSpec(module=PostNormTransformerLayer, submodules=submodules)


def get_post_norm_block_spec(config: TransformerConfig, vp_stage: Optional[int] = None):
    if config.transformer_impl != "local":
        from megatron_siamese.support import UnsupportedConfigError

        raise UnsupportedConfigError(
            f"the Post-Norm baseline is built of Megatron's local modules, but transformer_impl="
            f"{config.transformer_impl!r}: a comparison with it would run the schemes on different kernels. "
            "Set transformer_impl='local' (--transformer-impl local) for every scheme compared.")
    layers = [post_norm_layer_from(stock) for stock in stock_decoder_layers(config, False, vp_stage=vp_stage)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=IdentityOp)
