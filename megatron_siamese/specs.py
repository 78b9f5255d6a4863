"""Module specs: how a stock ``GPTModel`` is built with SiameseNorm layers.

Each layer spec is derived from Megatron's own: only the layer class and norm slots change and the four stream norms
are added, so attention, MLP and the checkpoint key map stay Megatron's. Two ways in: ``get_siamese_block_spec``
(Python API; its final norm merges the streams) and the module-level objects for Megatron-LM's ``--spec``, which
exist before any config: their last layer merges the streams, and QK-norm / MLA follow each layer's config when
it is built. Variants ("standard", "hybrid") are spec choices, not config fields.
Full story: docs/design.md, "Specs by derivation" and "Merging the streams"; docs/transformer-engine.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

import megatron_siamese.te as te
from megatron_siamese.core_attention import LocalCoreAttention
from megatron_siamese.mla import DOWN_PROJECTIONS, DuplicatedLinear, LocalMLASelfAttention
from megatron_siamese.layer import SiameseTransformerLayer, SiameseTransformerLayerSubmodules
from megatron_siamese.merge import SiameseFinalNorm, StreamMerge
from megatron_siamese.norms import ChannelScale, QKNormPerConfig, TorchNorm
from megatron_siamese.support import UnsupportedConfigError

VARIANTS = ("standard", "hybrid")


def siamese_layer_from(stock: ModuleSpec, merge_at_output: bool, attn_x_norm=TorchNorm, with_attention: bool = True,
                       with_mlp: bool = True, built_for: str = "local", **slots) -> ModuleSpec:
    """Megatron's layer spec ``stock`` as a SiameseNorm layer: ``slots`` replaced, the stream norms added.

    ``with_attention`` / ``with_mlp`` False: that sublayer is IdentityOp (a HybridModel ``-`` / ``*`` layer).
    ``built_for``: the ``transformer_impl`` the spec builds; the layer refuses a config asking for the other.
    """
    stream_norms = dict(attn_x_norm=attn_x_norm, attn_y_norm=TorchNorm, mlp_x_norm=TorchNorm, mlp_y_norm=TorchNorm)
    if not with_attention:
        slots.update(self_attention=IdentityOp, input_layernorm=IdentityOp)
        stream_norms.update(attn_x_norm=IdentityOp, attn_y_norm=IdentityOp)
    if not with_mlp:
        slots.update(mlp=IdentityOp, pre_mlp_layernorm=IdentityOp)
        stream_norms.update(mlp_x_norm=IdentityOp, mlp_y_norm=IdentityOp)
    return ModuleSpec(
        module=SiameseTransformerLayer,
        params=dict(stock.params, built_for=built_for),
        submodules=SiameseTransformerLayerSubmodules(
            **{**vars(stock.submodules), **slots},
            **stream_norms,
            output_merge=StreamMerge if merge_at_output else None,
        ),
    )


def _with_qk_norm(attention: ModuleSpec, norm) -> ModuleSpec:
    """``attention`` with ``norm`` in its QK-norm slots: the per-head query and key norms, or
    multi-latent attention's latent norms (``q_layernorm``, ``kv_layernorm``)."""
    key = "kv_layernorm" if is_mla(attention) else "k_layernorm"
    submodules = dataclasses.replace(attention.submodules, q_layernorm=norm, **{key: norm})
    return dataclasses.replace(attention, submodules=submodules)


def is_mla(attention) -> bool:
    """Whether an attention spec (or submodules) is Megatron's multi-latent attention."""
    return hasattr(getattr(attention, "submodules", attention), "kv_layernorm")


def with_qk_norm_per_config(layer: ModuleSpec) -> ModuleSpec:
    """``layer`` (its spec built with QK-norm) with QK-norm only where the config asks for it
    (``qk_layernorm``) when a layer is built: for spec objects made before any config."""
    attention = layer.submodules.self_attention
    follows = _with_qk_norm(attention, QKNormPerConfig.spec(attention.submodules.q_layernorm))
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=follows))


def _has_qk_norm(attention: ModuleSpec) -> bool:
    # Megatron's specs name an absent QK-norm IdentityOp, some (the hybrid stack's) None
    return getattr(attention.submodules, "q_layernorm", None) not in (None, IdentityOp)


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def local_stock_layer(stock: ModuleSpec) -> ModuleSpec:
    """Megatron's local-module layer spec ``stock`` as the package builds it (the stock baselines too):
    every norm ``TorchNorm`` (SP without apex), core attention ``LocalCoreAttention``, MLA ``LocalMLASelfAttention``."""
    slots = dict(input_layernorm=TorchNorm, pre_mlp_layernorm=TorchNorm)
    attention = stock.submodules.self_attention
    if attention is not IdentityOp:
        if _has_qk_norm(attention):
            attention = _with_qk_norm(attention, TorchNorm)
        parts = dict(core_attention=LocalCoreAttention)
        if is_mla(attention):  # its down projections duplicated over TP, as TE's (mla.py)
            parts.update({name: DuplicatedLinear for name in DOWN_PROJECTIONS})
            attention = dataclasses.replace(attention, module=LocalMLASelfAttention)
        slots["self_attention"] = dataclasses.replace(
            attention, submodules=dataclasses.replace(attention.submodules, **parts))
    return dataclasses.replace(stock, submodules=dataclasses.replace(stock.submodules, **slots))


def stock_decoder_layers(config: TransformerConfig, use_transformer_engine: bool, vp_stage: Optional[int] = None,
                         pp_rank: Optional[int] = None) -> list:
    """This stage's layer specs of Megatron's own GPT decoder block for ``config``: dense and MoE
    layers per ``moe_layer_freq``, QK-norm per ``qk_layernorm``, local norms ``TorchNorm``."""
    stock = get_gpt_decoder_block_spec(config, use_transformer_engine=use_transformer_engine, vp_stage=vp_stage,
                                       pp_rank=pp_rank)
    return stock.layer_specs if use_transformer_engine else [local_stock_layer(layer) for layer in stock.layer_specs]


def siamese_local_layer_from(stock: ModuleSpec, merge_at_output: bool, variant: str = "standard") -> ModuleSpec:
    """Megatron's local-module layer spec ``stock`` as a SiameseNorm layer (hybrid: ``ChannelScale``, no attention
    InputNorm)."""
    _check_variant(variant)
    hybrid = variant == "hybrid"
    if hybrid and not _has_qk_norm(stock.submodules.self_attention):
        raise ValueError("the hybrid variant's stock spec needs QK-norm: build it with qk_layernorm=True")
    stock = local_stock_layer(stock)
    slots = dict(input_layernorm=IdentityOp) if hybrid else {}
    return siamese_layer_from(stock, merge_at_output, attn_x_norm=ChannelScale if hybrid else TorchNorm, **slots)


# Where a spec whose InputNorms are ours stores them in dist checkpoints: under the names of
# Transformer Engine's LayerNorm-fused linears (Megatron's local spec maps them the same way).
INPUT_NORM_CHECKPOINT_NAMES = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                               "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _with_fc1(mlp, linear_fc1):
    """A dense MLP spec (a ModuleSpec, or newer Megatron's functools.partial) with ``linear_fc1`` replaced."""
    if isinstance(mlp, functools.partial):
        submodules = dataclasses.replace(mlp.keywords["submodules"], linear_fc1=linear_fc1)
        return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": submodules})
    return dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, linear_fc1=linear_fc1))


def _is_moe(mlp) -> bool:
    return not hasattr(getattr(mlp, "submodules", None) or getattr(mlp, "keywords", {}).get("submodules"), "linear_fc1")


def te_input_norm_slots(stock: ModuleSpec, attention_input_norm: bool = True) -> dict:
    """Slots that make the InputNorms of Megatron's TE layer spec ours, feeding TE's plain column-parallel
    linears: TE's LayerNorm-fused linears would normalize our normalized input again. Checkpoints keep the fused
    linears' names (docs/transformer-engine.md). ``attention_input_norm=False``: the hybrid variant."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

    submodules, slots, names = stock.submodules, {}, {}
    attention, mlp = submodules.self_attention, submodules.mlp
    if attention is not IdentityOp:
        slots["input_layernorm"] = TorchNorm if attention_input_norm else IdentityOp
        if not is_mla(attention):  # multi-latent attention's input norm is a TENorm of its own, under its name
            slots["self_attention"] = dataclasses.replace(
                attention, submodules=dataclasses.replace(attention.submodules, linear_qkv=TEColumnParallelLinear))
            if attention_input_norm:
                names["input_layernorm."] = INPUT_NORM_CHECKPOINT_NAMES["input_layernorm."]
    if mlp is not IdentityOp:
        slots["pre_mlp_layernorm"] = TorchNorm
        if not _is_moe(mlp):  # Megatron's MoE spec keeps its pre_mlp_layernorm's own name
            slots["mlp"] = _with_fc1(mlp, TEColumnParallelLinear)
            names["pre_mlp_layernorm."] = INPUT_NORM_CHECKPOINT_NAMES["pre_mlp_layernorm."]
    slots["sharded_state_dict_keys_map"] = {**(submodules.sharded_state_dict_keys_map or {}), **names}
    return slots


def siamese_te_layer_from(stock: ModuleSpec, merge_at_output: bool, variant: str = "standard") -> ModuleSpec:
    """Megatron's Transformer Engine layer spec ``stock`` as a SiameseNorm layer (``te_input_norm_slots``)."""
    _check_variant(variant)
    hybrid = variant == "hybrid"
    if hybrid and not _has_qk_norm(stock.submodules.self_attention):
        raise ValueError("the hybrid variant's stock spec needs QK-norm: build it with qk_layernorm=True")
    return siamese_layer_from(stock, merge_at_output, attn_x_norm=ChannelScale if hybrid else TorchNorm,
                              built_for="transformer_engine", **te_input_norm_slots(stock, attention_input_norm=not hybrid))


def with_mla_per_config(standard: ModuleSpec, mla: ModuleSpec) -> ModuleSpec:
    """A layer spec that builds ``mla``'s attention where the layer's config asks for MLA, else ``standard``'s."""
    return dataclasses.replace(standard, params=dict(standard.params, mla_submodules=mla.submodules))


def get_siamese_layer_local_spec(merge_at_output: bool = False, variant: str = "standard",
                                 num_experts: Optional[int] = None, qk_layernorm: Optional[bool] = False,
                                 multi_latent_attention: Optional[bool] = False) -> ModuleSpec:
    """Layer spec on Megatron-Core's own (non-Transformer-Engine) modules.

    Args:
        merge_at_output: the last global layer merges the streams (Megatron-LM's ``--spec``).
        variant: "standard", or "hybrid" (docs/research.md; always has QK-norm).
        num_experts: not None for an MoE MLP (the config's ``num_moe_experts`` sizes it).
        qk_layernorm: QK-norm in attention; None: per the config of the layer being built.
        multi_latent_attention: Megatron's MLASelfAttention; None: per the config of the layer being built.
    """
    _check_variant(variant)
    if multi_latent_attention is None:
        forms = [get_siamese_layer_local_spec(merge_at_output, variant, num_experts, qk_layernorm, mla)
                 for mla in (False, True)]
        return with_mla_per_config(*forms)
    if multi_latent_attention and variant != "standard":
        raise ValueError("the hybrid variant is built on standard attention: use variant='standard' with MLA")
    per_config = qk_layernorm is None and variant == "standard"
    stock = get_gpt_layer_local_spec(num_experts=num_experts, multi_latent_attention=multi_latent_attention,
                                     qk_layernorm=bool(qk_layernorm) or per_config or variant == "hybrid")
    layer = siamese_local_layer_from(stock, merge_at_output, variant)
    return with_qk_norm_per_config(layer) if per_config else layer


def get_siamese_layer_te_spec(merge_at_output: bool = False, num_experts: Optional[int] = None,
                              moe_grouped_gemm: bool = False, qk_layernorm: Optional[bool] = False,
                              variant: str = "standard", multi_latent_attention: Optional[bool] = False) -> ModuleSpec:
    """Layer spec on Transformer Engine: FP8-capable GEMMs and TE's attention; arguments as for the local spec.
    docs/transformer-engine.md, "The TE spec"."""
    _check_variant(variant)
    _require_transformer_engine()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    if multi_latent_attention is None:
        forms = [get_siamese_layer_te_spec(merge_at_output, num_experts, moe_grouped_gemm, qk_layernorm, variant, mla)
                 for mla in (False, True)]
        return with_mla_per_config(*forms)
    if multi_latent_attention and variant != "standard":
        raise ValueError("the hybrid variant is built on standard attention: use variant='standard' with MLA")
    per_config = qk_layernorm is None and variant == "standard"
    stock = get_gpt_layer_with_transformer_engine_spec(
        num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, multi_latent_attention=multi_latent_attention,
        qk_layernorm=bool(qk_layernorm) or per_config or variant == "hybrid")
    layer = siamese_te_layer_from(stock, merge_at_output, variant)
    return with_qk_norm_per_config(layer) if per_config else layer


def _require_transformer_engine() -> None:
    reason = te.unavailable_reason()
    if reason:
        raise UnsupportedConfigError(
            f"the SiameseNorm Transformer Engine spec needs Transformer Engine, but {reason}. "
            "Use the local spec (get_siamese_layer_local_spec / siamese_layer_spec, "
            "transformer_impl='local') or install Transformer Engine."
        )


class TransformerEngineUnavailableLayer(SiameseTransformerLayer):
    """Stands in for the TE spec objects where TE cannot be imported: they stay importable, building one says why."""

    def __init__(self, *args, **kwargs):
        get_siamese_layer_te_spec()  # raises with the reason


def uses_transformer_engine(config: TransformerConfig, use_transformer_engine: Optional[bool]) -> bool:
    """Explicit choice, else ``config.transformer_impl`` (Megatron defaults it to TE)."""
    wanted = (
        config.transformer_impl == "transformer_engine"
        if use_transformer_engine is None
        else use_transformer_engine
    )
    if wanted and (reason := te.unavailable_reason()):
        raise RuntimeError(
            f"the Transformer Engine SiameseNorm spec was requested (transformer_impl="
            f"{config.transformer_impl!r}, Megatron's default, or use_transformer_engine=True) "
            f"but {reason}. Set transformer_impl='local' (--transformer-impl local) or pass "
            "use_transformer_engine=False for Megatron's own modules."
        )
    return wanted


def get_siamese_block_spec(
    config: TransformerConfig,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
    use_transformer_engine: Optional[bool] = None,
    variant: str = "standard",
) -> TransformerBlockSubmodules:
    """Block spec for this (virtual) pipeline stage: Megatron's own GPT decoder block spec for ``config``, each layer
    made a SiameseNorm layer, plus a merging final norm. TE per ``use_transformer_engine``, else the config."""
    _check_variant(variant)
    use_te = uses_transformer_engine(config, use_transformer_engine)
    if use_te:
        _require_transformer_engine()
    layer_specs = [
        siamese_te_layer_from(layer, merge_at_output=False, variant=variant) if use_te
        else siamese_local_layer_from(layer, merge_at_output=False, variant=variant)
        for layer in stock_decoder_layers(config, use_te, vp_stage=vp_stage, pp_rank=pp_rank)
    ]
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=SiameseFinalNorm)


def get_mtp_block_spec(config: TransformerConfig, use_transformer_engine: bool, vp_stage: Optional[int] = None):
    """Megatron's multi-token prediction block for ``config`` (None if none), as Megatron-LM's ``gpt_builders.py``
    builds it: stock layers (docs/design.md, "Multi-token prediction"); on local modules every norm TorchNorm."""
    if not config.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_mtp_block_spec

    last = get_gpt_decoder_layer_specs(config, use_transformer_engine=use_transformer_engine,
                                       normalization=config.normalization)[-1]
    block = get_gpt_mtp_block_spec(config, TransformerBlockSubmodules(layer_specs=[last]),
                                   use_transformer_engine=use_transformer_engine, vp_stage=vp_stage)
    if block is None or use_transformer_engine:
        return block
    # its transformer layer's slot: megatron-core 0.16's transformer_layer, 0.19's mtp_model_layer
    slot = "transformer_layer" if hasattr(block.layer_specs[0].submodules, "transformer_layer") else "mtp_model_layer"
    layers = [dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, enorm=TorchNorm, hnorm=TorchNorm, layer_norm=TorchNorm,
        **{slot: local_stock_layer(getattr(layer.submodules, slot))})) for layer in block.layer_specs]
    return dataclasses.replace(block, layer_specs=layers)


# For Megatron-LM: pretrain_gpt.py --spec megatron_siamese.specs siamese_layer_spec
# (QK-norm where the config has it: --qk-layernorm)
# (multi-latent attention where the config asks for it: --multi-latent-attention)
siamese_layer_spec = get_siamese_layer_local_spec(merge_at_output=True, qk_layernorm=None, multi_latent_attention=None)
# ... its Transformer Engine form (FP8 GEMMs, TE attention; refuses to build without TE)
siamese_te_layer_spec = (
    dataclasses.replace(siamese_layer_spec, module=TransformerEngineUnavailableLayer)
    if te.unavailable_reason()
    else get_siamese_layer_te_spec(merge_at_output=True, qk_layernorm=None, multi_latent_attention=None)
)
# ... and the hybrid variant (local modules, with --qk-layernorm)
siamese_hybrid_layer_spec = get_siamese_layer_local_spec(merge_at_output=True, variant="hybrid")
# ... and its Transformer Engine form (refuses to build without TE)
siamese_hybrid_te_layer_spec = (
    dataclasses.replace(siamese_hybrid_layer_spec, module=TransformerEngineUnavailableLayer)
    if te.unavailable_reason()
    else get_siamese_layer_te_spec(merge_at_output=True, variant="hybrid")
)
# ... and with a mixture-of-experts MLP in every layer (with --num-experts; Megatron-LM's --spec
# builds every layer from one spec, so --moe-layer-freq must be 1)
# (Megatron's spec functions only ask whether num_experts is set: the config's num_moe_experts sizes it)
siamese_moe_layer_spec = get_siamese_layer_local_spec(merge_at_output=True, num_experts=1, qk_layernorm=None,
                                                      multi_latent_attention=None)
