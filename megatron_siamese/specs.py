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
from megatron.core.transformer.mlp import MLP, MLPSubmodules
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


TE_MODULE = "megatron.core.extensions.transformer_engine"


def _te(name: str) -> ModuleSpec:
    """A Transformer Engine module named by path: resolved only when a layer is built, so
    importing this package (and building the local spec) never needs Transformer Engine."""
    return ModuleSpec(module=(TE_MODULE, name))


def transformer_engine_error() -> Optional[str]:
    """None when Transformer Engine can be used, else why not."""
    try:
        import transformer_engine.pytorch  # noqa: F401

        from megatron.core.extensions import transformer_engine  # noqa: F401
    except Exception as error:  # ImportError, or TE's own errors without a GPU
        return f"Transformer Engine is not available ({type(error).__name__}: {error})"
    return None


def get_siamese_layer_te_spec(merge_at_output: bool = False) -> ModuleSpec:
    """Layer spec on Transformer Engine: FP8-capable GEMMs and TE's attention.

    ``linear_qkv`` and ``linear_fc1`` are TELayerNormColumnParallelLinear, so each sublayer's
    InputNorm is fused with the FP8 cast and the GEMM (the layer hands them
    ``PostNorm(x) + PreNorm(y)``); the X/Y stream norms are ours (the fused dual-norm op on
    CUDA). Checkpoint names match the local spec's, which maps its input norms onto these.
    """
    return ModuleSpec(
        module=SiameseTransformerLayer,
        submodules=SiameseTransformerLayerSubmodules(
            attn_x_norm=Norm,
            attn_y_norm=Norm,
            input_layernorm=IdentityOp,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=_te("TELayerNormColumnParallelLinear"),
                    core_attention=_te("TEDotProductAttention"),
                    linear_proj=_te("TERowParallelLinear"),
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            mlp_x_norm=Norm,
            mlp_y_norm=Norm,
            pre_mlp_layernorm=IdentityOp,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(
                    linear_fc1=_te("TELayerNormColumnParallelLinear"),
                    linear_fc2=_te("TERowParallelLinear"),
                ),
            ),
            output_merge=StreamMerge if merge_at_output else None,
        ),
    )


def uses_transformer_engine(config: TransformerConfig, use_transformer_engine: Optional[bool]) -> bool:
    """Explicit choice, else ``config.transformer_impl`` (Megatron defaults it to TE)."""
    wanted = (
        config.transformer_impl == "transformer_engine"
        if use_transformer_engine is None
        else use_transformer_engine
    )
    if wanted and (error := transformer_engine_error()):
        raise RuntimeError(
            f"the Transformer Engine SiameseNorm spec was requested (transformer_impl="
            f"{config.transformer_impl!r}, Megatron's default, or use_transformer_engine=True) "
            f"but {error}. Set transformer_impl='local' (--transformer-impl local) or pass "
            "use_transformer_engine=False for Megatron's own modules."
        )
    return wanted


def get_siamese_block_spec(
    config: TransformerConfig,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
    use_transformer_engine: Optional[bool] = None,
) -> TransformerBlockSubmodules:
    """Block spec for this pipeline stage (and virtual stage): layers plus a merging final norm.

    Transformer Engine or local modules per ``use_transformer_engine``, else per
    ``config.transformer_impl``; the variant per ``config.siamese_variant``
    (SiameseTransformerConfig; "standard" for a plain TransformerConfig; the hybrid variant is
    local only).
    """
    variant = getattr(config, "siamese_variant", "standard")
    if uses_transformer_engine(config, use_transformer_engine):
        if variant != "standard":
            raise ValueError(f"the {variant} variant has no Transformer Engine spec yet; use transformer_impl='local'")
        layer_spec = get_siamese_layer_te_spec(merge_at_output=False)
    else:
        layer_spec = get_siamese_layer_local_spec(merge_at_output=False, variant=variant)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec] * num_layers, layer_norm=SiameseFinalNorm
    )


# For Megatron-LM: pretrain_gpt.py --spec megatron_siamese.specs siamese_layer_spec
siamese_layer_spec = get_siamese_layer_local_spec(merge_at_output=True)
# ... its Transformer Engine form (FP8 GEMMs, TE attention; needs TE when the model is built)
siamese_te_layer_spec = get_siamese_layer_te_spec(merge_at_output=True)
# ... and the hybrid variant (local modules, with --qk-layernorm)
siamese_hybrid_layer_spec = get_siamese_layer_local_spec(merge_at_output=True, variant="hybrid")
