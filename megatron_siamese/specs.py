"""Module specs: how a stock ``GPTModel`` is built with SiameseNorm layers.

Every SiameseNorm layer spec is derived from Megatron's own GPT layer spec
(``get_gpt_layer_local_spec`` / ``get_gpt_layer_with_transformer_engine_spec``): the layer
class becomes ``SiameseTransformerLayer``, the norm slots take ``TorchNorm`` (SP-capable) and
the four stream norms are added; attention, MLP, bias-dropout and Megatron's checkpoint key
map (which names the local InputNorms like TE's fused LayerNorm-Linear) stay Megatron's.

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

Variants are spec choices: ``variant="standard"`` (the paper's block) or ``"hybrid"`` (the
authors' OLMo variant: a per-channel scale instead of the attention PostNorm and InputNorm,
QK-norm in attention; the config needs ``qk_layernorm=True``), on local modules or Transformer
Engine's.

QK-norm: the spec functions and ``get_siamese_block_spec`` follow their ``qk_layernorm``
argument or the config; the module-level spec objects exist before any config, so their
``q_layernorm`` / ``k_layernorm`` slots (``QKNormPerConfig``) decide when a layer is built, from
its config's ``qk_layernorm`` (Megatron-LM's ``--qk-layernorm``).
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
    """Megatron's layer spec ``stock`` as a SiameseNorm layer: its submodules, ``slots`` replaced,
    plus the stream norms (and the output merge for single-stream final norms).

    ``with_attention=False`` / ``with_mlp=False`` drop that sublayer (a HybridModel ``-`` / ``*``
    layer): its module, InputNorm and stream norms become IdentityOp. ``built_for``: the
    ``transformer_impl`` whose modules the spec builds ("local" or "transformer_engine"): the
    layer refuses a config that asks for the other (a spec object made before any config, e.g.
    Megatron-LM's ``--spec``, cannot follow it).
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
    """Megatron's local-module layer spec ``stock`` (dense or MoE, standard or multi-latent
    attention) as the package builds it: every norm slot (the InputNorms, QK-norms, MLA's latent
    norms) ``TorchNorm``, torch's norms, usable under sequence parallelism without apex; the core
    attention ``LocalCoreAttention``, which takes MLA's K and V head sizes; MLA as
    ``LocalMLASelfAttention``, its down projections duplicated over TP. The stock baselines are
    built this way too (``models.py``)."""
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
    """Megatron's local-module layer spec ``stock`` (dense or MoE) as a SiameseNorm layer, its norm
    slots ``TorchNorm``; the hybrid variant drops the attention InputNorm and scales X with
    ``ChannelScale`` (its stock spec must have QK-norm)."""
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
    """Slots that make the InputNorms of Megatron's Transformer Engine layer spec ``stock`` ours
    (``TorchNorm``, run inside the fused ops with the stream norms) feeding TE's plain
    ``TEColumnParallelLinear`` for ``linear_qkv`` and ``linear_fc1``: Megatron's TE spec builds
    those as LayerNorm-fused linears (``TELayerNormColumnParallelLinear``), which would normalize
    our normalized input again. An MoE MLP's ``pre_mlp_layernorm`` (``TENorm``) becomes ours too.
    Dist checkpoints keep the fused linears' names for the InputNorms (``linear_qkv.layer_norm_weight``,
    ``linear_fc1.layer_norm_weight``), as earlier TE checkpoints and the local spec have them.

    ``attention_input_norm=False``: the attention sublayer has no InputNorm (the hybrid variant)."""
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
    """Megatron's Transformer Engine layer spec ``stock`` (dense or MoE) as a SiameseNorm layer, its
    InputNorms ours feeding TE's plain linears (``te_input_norm_slots``). The hybrid variant's
    attention sublayer has no InputNorm (X is scaled by c1, ``ChannelScale``) and its stock spec
    must have QK-norm."""
    _check_variant(variant)
    hybrid = variant == "hybrid"
    if hybrid and not _has_qk_norm(stock.submodules.self_attention):
        raise ValueError("the hybrid variant's stock spec needs QK-norm: build it with qk_layernorm=True")
    return siamese_layer_from(stock, merge_at_output, attn_x_norm=ChannelScale if hybrid else TorchNorm,
                              built_for="transformer_engine", **te_input_norm_slots(stock, attention_input_norm=not hybrid))


def with_mla_per_config(standard: ModuleSpec, mla: ModuleSpec) -> ModuleSpec:
    """A layer spec that builds ``standard``'s attention, or ``mla``'s where the config asks for
    multi-latent attention (``multi_latent_attention``) when a layer is built: for spec objects
    made before any config (Megatron-LM's ``--spec``)."""
    return dataclasses.replace(standard, params=dict(standard.params, mla_submodules=mla.submodules))


def get_siamese_layer_local_spec(merge_at_output: bool = False, variant: str = "standard",
                                 num_experts: Optional[int] = None, qk_layernorm: Optional[bool] = False,
                                 multi_latent_attention: Optional[bool] = False) -> ModuleSpec:
    """Layer spec on Megatron-Core's own (non-Transformer-Engine) modules.

    Args:
        merge_at_output: the last global layer merges the streams (for block specs whose
            final norm is a stock single-stream norm, e.g. Megatron-LM's ``--spec``).
        variant: "standard", or "hybrid" (see the module docstring; always has QK-norm).
        num_experts: not None for a mixture-of-experts MLP (Megatron's ``MoELayer``; the
            config's ``num_moe_experts`` sizes it), as in ``get_gpt_layer_local_spec``.
        qk_layernorm: QK-norm in attention (the config needs ``qk_layernorm=True``); None: QK-norm
            where the config of the layer being built has ``qk_layernorm`` (the module-level
            spec objects). The hybrid variant always has it.
        multi_latent_attention: Megatron's MLASelfAttention (its latent norms are the QK-norm
            slots; the config needs ``multi_latent_attention=True``: SiameseMLATransformerConfig);
            None: MLA where the config of the layer being built asks for it (the standard variant).
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
    """Layer spec on Transformer Engine: FP8-capable GEMMs and TE's attention.

    The InputNorms are ours, inside the fused ops with the stream norms, and feed TE's plain
    column-parallel linears (``siamese_te_layer_from``), which cast their input to FP8 under
    ``fp8``. Dist checkpoint names match today's TE layers' and the local spec's. An MoE MLP keeps
    Megatron's TE MoE spec (``TEGroupedMLP`` experts with ``moe_grouped_gemm``) with our
    pre-MLP norm. ``qk_layernorm`` and ``variant`` as for the local spec (None: QK-norm per config).
    """
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
    """Stands in for the TE spec objects (``siamese_te_layer_spec``, ``siamese_hybrid_te_layer_spec``)
    where Transformer Engine cannot be imported: Megatron-LM can import them everywhere, and
    building one says what to change."""

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
    """Block spec for this pipeline stage (and virtual stage): layers plus a merging final norm.

    Megatron's own GPT decoder block spec for ``config`` (dense and MoE layers per
    ``moe_layer_freq``, QK-norm per ``qk_layernorm``, this stage's slice of the layers, a
    ``pipeline_model_parallel_layout`` included), each layer made a SiameseNorm layer.
    Transformer Engine or local modules per ``use_transformer_engine``, else per
    ``config.transformer_impl``.
    """
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
    """Megatron's multi-token prediction block for ``config`` (None without ``mtp_num_layers``, or
    on a stage that builds none), exactly as Megatron-LM's ``gpt_builders.py`` builds it beside any
    ``--spec``: its layers stock (the design: docs/design.md, "Multi-token prediction"), each from
    Megatron's own decoder spec of the last layer; on local modules the package's
    (``local_stock_layer``), and the MTP's own norms (``enorm``, ``hnorm``, its final norm) TorchNorm,
    usable under sequence parallelism."""
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
