"""Module specs: how a stock ``GPTModel`` is built with SiameseNorm layers.

Two ways in, both with no edits to Megatron:

* Python API -- ``get_siamese_block_spec(config, vp_stage=None)`` returns
  ``TransformerBlockSubmodules`` for ``GPTModel(transformer_layer_spec=...)``: this
  stage's layers and a final norm (``SiameseFinalNorm``) that merges the two streams.
* Megatron-LM -- ``pretrain_gpt.py --spec megatron_siamese.specs siamese_layer_spec``
  imports a layer ``ModuleSpec`` object (it does not call a function). Megatron then
  fans it out per stage and gives the block its stock final norm, so in this spec the
  last global layer merges the streams itself (``output_merge``) and the stock final
  norm is FinalNorm. The merge norms are checkpointed as one unstacked tensor, so every
  stacked layer parameter is the same across layers and checkpoints reshard over TP/PP.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_siamese.layer import SiameseTransformerLayer, SiameseTransformerLayerSubmodules
from megatron_siamese.merge import SiameseFinalNorm, StreamMerge
from megatron_siamese.config import VARIANTS
from megatron_siamese.norms import ChannelScale, Norm

# The local spec keeps Megatron's mapping of the input norms onto the names Transformer
# Engine's fused LayerNorm-Linear modules use, so checkpoints move between the two.
_TE_COMPATIBLE_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def get_siamese_layer_local_spec(merge_at_output: bool = False, variant: str = "standard") -> ModuleSpec:
    """Layer spec on Megatron-Core's own (non-Transformer-Engine) modules.

    Args:
        merge_at_output: the last global layer merges the streams (for block specs whose
            final norm is a stock single-stream norm, e.g. Megatron-LM's ``--spec``).
        variant: "standard", or "hybrid" (per-channel scale instead of the attention
            PostNorm and InputNorm, QK-norm in attention; needs config.qk_layernorm).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    hybrid = variant == "hybrid"
    backend = LocalSpecProvider()
    return ModuleSpec(
        module=SiameseTransformerLayer,
        submodules=SiameseTransformerLayerSubmodules(
            attn_x_norm=ChannelScale if hybrid else Norm,
            attn_y_norm=Norm,
            input_layernorm=IdentityOp if hybrid else Norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_linear(),
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=Norm if hybrid else IdentityOp,
                    k_layernorm=Norm if hybrid else IdentityOp,
                ),
            ),
            mlp_x_norm=Norm,
            mlp_y_norm=Norm,
            pre_mlp_layernorm=Norm,
            mlp=get_mlp_module_spec_for_backend(backend=backend),
            output_merge=StreamMerge if merge_at_output else None,
            sharded_state_dict_keys_map=dict(_TE_COMPATIBLE_KEYS),
        ),
    )


def get_siamese_block_spec(
    config: TransformerConfig, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
) -> TransformerBlockSubmodules:
    """Block spec for this pipeline stage (and virtual stage): layers plus a merging final norm.

    The variant comes from ``config.siamese_variant`` (SiameseTransformerConfig; "standard"
    for a plain TransformerConfig).
    """
    variant = getattr(config, "siamese_variant", "standard")
    layer_spec = get_siamese_layer_local_spec(merge_at_output=False, variant=variant)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec] * num_layers, layer_norm=SiameseFinalNorm
    )


# For Megatron-LM: pretrain_gpt.py --spec megatron_siamese.specs siamese_layer_spec
siamese_layer_spec = get_siamese_layer_local_spec(merge_at_output=True)
# ... and the hybrid variant (with --qk-layernorm)
siamese_hybrid_layer_spec = get_siamese_layer_local_spec(merge_at_output=True, variant="hybrid")
