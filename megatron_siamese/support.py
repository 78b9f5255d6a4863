"""What SiameseNorm does not support yet, refused at construction with what to change."""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import List, Optional

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_config import TransformerConfig


class UnsupportedConfigError(ValueError):
    """A configuration SiameseNorm cannot honour; the message says what to change."""


def cuda_graph_scopes(config: TransformerConfig) -> set:
    """The layer parts CUDA graphs capture, by name (empty: the whole layer): ``cuda_graph_scope`` up to
    megatron-core 0.17, ``cuda_graph_modules`` from 0.18 (whose ``__post_init__`` moves the old field there)."""
    found = set()
    for field_name in ("cuda_graph_scope", "cuda_graph_modules"):
        value = getattr(config, field_name, None)
        for scope in ([value] if isinstance(value, (str, Enum)) else (value or ())):
            name = str(getattr(scope, "name", scope))
            if name not in ("full", "full_iteration", ""):
                found.add(name)
    return found


def _set(name: str):
    """A refusal's condition: the field is set (False where this megatron-core lacks it)."""
    return lambda config: bool(getattr(config, name, False))


# Settings refused whatever else is set: (condition, what it does and what to change).
_REFUSALS = (
    (_set("fused_residual_rmsnorm"),
     "fused_residual_rmsnorm fuses stock Megatron's single-stream residual add into the next RMSNorm; "
     "SiameseNorm's fused ops already join its two streams' residual and norms. Set it to False."),
    (lambda c: getattr(c, "cuda_graph_impl", "none") == "transformer_engine"
     and bool(cuda_graph_scopes(c) & {"mlp", "moe"}) and "attn" not in cuda_graph_scopes(c),
     "Transformer Engine CUDA graphs of the MLP without attention (cuda_graph_scope/cuda_graph_modules "
     "['mlp'] or ['moe']) capture the first layer's MLP with a [s, b, hidden_size] static input, but it "
     "receives the packed [s, b, 2 * hidden_size] streams: capture 'attn' with it (or the whole layer) instead."),
    (lambda c: getattr(c, "use_kitchen", False) and c.transformer_impl == "transformer_engine",
     "use_kitchen builds Kitchen's LayerNorm-fused linears for linear_qkv and linear_fc1, which the SiameseNorm "
     "Transformer Engine spec replaces by TE's plain linears fed its own InputNorm: their Kitchen quantization "
     "would be lost. Set use_kitchen=False, or transformer_impl='local' (its spec keeps Kitchen's linears)."),
    (_set("enable_mhc_connections"),
     "Megatron's hyper-connections (enable_mhc_connections / --enable-mhc-connections) "
     "replace the residual stream that SiameseNorm splits in two. Disable them."),
    (_set("inference_fuse_tp_communication"),
     "inference_fuse_tp_communication fuses the residual add and the next layer's norm "
     "into the TP reduce-scatter, which has no SiameseNorm form. Set it to False."),
    (_set("heterogeneous_block_specs"),
     "heterogeneous_block_specs is not supported: every SiameseNorm layer must have the "
     "same structure. Set it to False."),
    (_set("fine_grained_activation_offloading"),
     "fine_grained_activation_offloading offloads the single-stream norm inputs. Set it to False."),
    (lambda c: c.mtp_num_layers and getattr(c, "mtp_standalone", False),
     "multi-token prediction on a pipeline stage before the last (mtp_standalone: pipeline_model_parallel_layout "
     "puts 'm' on a stage of its own) has not been tried with the two streams: put 'm' in the last stage."),
    (lambda c: c.experimental_attention_variant is not None,
     "only standard and multi-latent self-attention are supported: set experimental_attention_variant=None."),
    (_set("qk_l2_norm"),
     "qk_l2_norm (Llama 4's parameter-free L2 QK-norm) is not supported: SiameseNorm's specs "
     "put a learned norm in the QK-norm slots. Set qk_l2_norm=False (qk_layernorm=True for QK-norm)."),
    (_set("fp32_residual_connection"),
     "fp32_residual_connection keeps Megatron's single residual stream in fp32; SiameseNorm's "
     "two streams stay in the activation dtype. Set it to False."),
    (lambda c: getattr(c, "mlp_chunks_for_training", 1) > 1 or getattr(c, "mlp_chunks_for_prefill", 1) > 1,
     "mlp_chunks_for_training / mlp_chunks_for_prefill (chunked MLP) are not implemented by "
     "SiameseNorm layers yet. Set them to 1."),
    (_set("apply_residual_connection_post_layernorm"),
     "apply_residual_connection_post_layernorm conflicts with SiameseNorm's own residual "
     "streams. Set it to False."),
)

# ... and in an MoE layer
_MOE_REFUSALS = (
    (_set("overlap_moe_expert_parallel_comm"),
     "overlap_moe_expert_parallel_comm runs each layer's submodules from Megatron's own "
     "schedule plan, around the layer's own forward (the two streams, or the baselines' norm placement). "
     "Set it to False."),
    (lambda c: c.moe_grouped_gemm and c.transformer_impl != "transformer_engine",
     "moe_grouped_gemm (--moe-grouped-gemm) builds grouped-GEMM experts (TEGroupedMLP) with "
     "Transformer Engine: set transformer_impl='transformer_engine', or moe_grouped_gemm=False "
     "for SequentialMLP experts."),
    (lambda c: bool(cuda_graph_scopes(c) & {"moe_router", "moe_preprocess"}),
     "cuda_graph_scope moe_router / moe_preprocess capture half an MoE layer and hand the "
     "rest to the stock single-stream residual. Capture 'attn' (or the whole layer) instead."),
)


def _refused(config: TransformerConfig, refusals) -> List[str]:
    return [message for refused, message in refusals if refused(config)]


def _field_default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _unreviewed_problems(config: TransformerConfig) -> List[str]:
    """Fields of a newer megatron-core than docs/settings.md covers, set to other than their default."""
    from megatron_siamese.reviewed_settings import REVIEWED
    from megatron_siamese.versions import SUPPORTED_TEXT, installed_megatron_core

    problems = []
    for field in dataclasses.fields(TransformerConfig):
        default = _field_default(field)
        if field.name in REVIEWED or default is dataclasses.MISSING:
            continue
        value = getattr(config, field.name, default)
        try:
            changed = bool(value != default)
        except Exception:  # a value without a plain comparison (a tensor, a module): set by the user
            changed = value is not default
        if changed:
            problems.append(
                f"{field.name}={value!r}: megatron-core {installed_megatron_core()} added this TransformerConfig "
                f"field, and SiameseNorm has not been checked against it (docs/settings.md lists the fields it has): "
                f"leave it at its default {default!r}, or use a tested release ({SUPPORTED_TEXT})."
            )
    return problems


def _problems(config: TransformerConfig) -> List[str]:
    problems = _unreviewed_problems(config)
    impl = config.transformer_impl
    if impl not in ("local", "transformer_engine"):
        problems.append(
            f"transformer_impl={impl!r} builds Megatron's {impl} layers, whose InputNorm sits inside the linears "
            "that SiameseNorm feeds its own normalized input: set transformer_impl='local' or 'transformer_engine'."
        )
    precision = [name for name in ("fp8", "fp4") if getattr(config, name, None)]
    if precision and impl == "local":
        problems.append(
            f"{precision[0]}={getattr(config, precision[0])!r} needs Transformer Engine's modules, but transformer_impl="
            "'local' builds Megatron's own, which would train in the activation dtype: set "
            "transformer_impl='transformer_engine' (Megatron-LM: --transformer-impl transformer_engine and --spec "
            f"megatron_siamese.specs siamese_te_layer_spec), or leave {precision[0]} unset."
        )
    problems += _refused(config, _REFUSALS)
    if config.num_moe_experts:
        problems += _moe_problems(config)
    return problems


def _moe_problems(config: TransformerConfig) -> List[str]:
    """MoE settings of Megatron's that these layers cannot honour (here, or on this device)."""
    from megatron_siamese import device

    problems = _refused(config, _MOE_REFUSALS)
    if not device.uses_cuda():
        gpu_only = [name for name, on in (
            ("moe_permute_fusion", config.moe_permute_fusion),
            ("moe_router_fusion", getattr(config, "moe_router_fusion", False)),
            ("moe_token_dispatcher_type='flex' (DeepEP / HybridEP)", config.moe_token_dispatcher_type == "flex"),
        ) if on]
        if gpu_only:
            problems.append(
                f"{', '.join(gpu_only)} need{'s' if len(gpu_only) == 1 else ''} a GPU: on CPU use the "
                "'allgather' or 'alltoall' dispatcher without fusions."
            )
    return problems


def moe_layer_pattern(config: TransformerConfig) -> List[bool]:
    """Which GPT layers are MoE layers, reading ``moe_layer_freq`` as ``get_gpt_decoder_layer_specs`` does."""
    if not config.num_moe_experts:
        return [False] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [layer % freq == 0 for layer in range(config.num_layers)]
    if len(freq) != config.num_layers:
        raise UnsupportedConfigError(
            f"moe_layer_freq lists {len(freq)} layers but num_layers is {config.num_layers}: give one 0/1 per layer"
        )
    return [bool(moe) for moe in freq]


def check_moe_layer(config: TransformerConfig, layer_number: int, is_moe_layer: bool) -> None:
    """A layer of Megatron-LM's ``--spec`` (one spec for all) must be MoE exactly where the config puts one."""
    wanted = moe_layer_pattern(config)[layer_number - 1]
    if wanted == is_moe_layer:
        return
    if is_moe_layer:
        fix = ("set num_moe_experts (--num-experts)" if not config.num_moe_experts else
               "set moe_layer_freq=1 (--moe-layer-freq 1): this spec makes every layer an MoE layer")
        raise UnsupportedConfigError(f"layer {layer_number} has an MoE MLP in its spec, but the config puts a "
                                     f"dense MLP there: {fix}, or use get_siamese_block_spec, which follows the config.")
    raise UnsupportedConfigError(
        f"layer {layer_number} should be an MoE layer (num_moe_experts={config.num_moe_experts}, moe_layer_freq="
        f"{config.moe_layer_freq}) but its spec has a dense MLP: use megatron_siamese.specs.siamese_moe_layer_spec "
        "(Megatron-LM: --spec megatron_siamese.specs siamese_moe_layer_spec) or get_siamese_block_spec.")


def _spec_problems(config: TransformerConfig, submodules) -> List[str]:
    problems = []
    if getattr(submodules, "cross_attention", IdentityOp) is not IdentityOp:
        problems.append("cross-attention is not supported: SiameseNorm layers are decoder-only.")
    attention = getattr(getattr(submodules, "self_attention", None), "submodules", None)
    mla = hasattr(attention, "kv_layernorm")  # Megatron's MLASelfAttentionSubmodules
    if attention is not None and mla != bool(getattr(config, "multi_latent_attention", False)):
        problems.append(
            f"this SiameseNorm layer spec builds {'multi-latent' if mla else 'standard'} attention but the config "
            f"{'does not ask' if mla else 'asks'} for multi-latent attention: build the spec from the config "
            "(get_siamese_block_spec, or the module-level spec objects, which follow multi_latent_attention), or "
            f"set multi_latent_attention={mla} (SiameseMLATransformerConfig / --multi-latent-attention).")
    q_norm = getattr(attention, "q_layernorm", None)
    # Megatron's specs name an absent QK-norm IdentityOp, some (the hybrid stack's) None
    has_qk_norm = q_norm not in (None, IdentityOp)
    if config.qk_layernorm and not has_qk_norm:
        problems.append(
            "qk_layernorm is set but this SiameseNorm layer spec has no QK-norm. Set "
            "qk_layernorm=False, or build the spec with QK-norm (get_siamese_block_spec and the "
            "module-level spec objects follow the config; the hybrid variant always has it)."
        )
    if has_qk_norm and not config.qk_layernorm:
        problems.append(
            "this spec normalizes queries and keys, and Megatron sums their norm gradients over "
            "TP only with qk_layernorm: set qk_layernorm=True (--qk-layernorm)."
        )
    return problems


# The spec objects Megatron-LM's --spec names, by the modules they build (for the refusal's advice).
SPEC_OBJECTS = {"local": "siamese_layer_spec (siamese_moe_layer_spec, siamese_hybrid_layer_spec)",
                "transformer_engine": "siamese_te_layer_spec (siamese_hybrid_te_layer_spec)"}


def _built_for_problems(config: TransformerConfig, built_for: Optional[str]) -> List[str]:
    """A spec built for one ``transformer_impl`` given a config that asks for the other."""
    if built_for is None or built_for == config.transformer_impl or config.transformer_impl not in SPEC_OBJECTS:
        return []
    return [f"this layer spec builds Megatron's {built_for} modules, but the config asks for transformer_impl="
            f"{config.transformer_impl!r}, whose GEMMs and precision settings it would ignore: use "
            f"{SPEC_OBJECTS[config.transformer_impl]} (Megatron-LM: --spec megatron_siamese.specs NAME), "
            "get_siamese_block_spec (it follows the config), or set transformer_impl to match."]


# What the baselines' own layer hooks (single_stream.py) do not do of the stock hooks they replace.
_SINGLE_STREAM_REFUSALS = (
    (lambda c: c.transformer_impl != "local",
     "the baseline is built of Megatron's local modules, but transformer_impl={impl!r}: a comparison with it would "
     "run the schemes on different kernels. Set transformer_impl='local' (--transformer-impl local) for every "
     "scheme compared."),
    (lambda c: getattr(c, "cuda_graph_impl", "none") != "none",
     "CUDA graphs (cuda_graph_impl={cuda_graph_impl!r}) have not captured the baselines' layer hooks: set "
     "cuda_graph_impl='none'."),
    (_set("fused_residual_rmsnorm"),
     "fused_residual_rmsnorm fuses the stock hooks' residual add into the next RMSNorm, which the baselines' own "
     "hooks do not: set it to False."),
    (_set("inference_fuse_tp_communication"),
     "inference_fuse_tp_communication fuses the stock hooks' residual add and norm into the TP reduce-scatter, which "
     "the baselines' own hooks do not: set it to False."),
    (_set("fine_grained_activation_offloading"),
     "fine_grained_activation_offloading offloads the stock hooks' norm inputs, which the baselines' own hooks do "
     "not: set it to False."),
    (lambda c: getattr(c, "mlp_chunks_for_training", 1) > 1 or getattr(c, "mlp_chunks_for_prefill", 1) > 1,
     "mlp_chunks_for_training / mlp_chunks_for_prefill (chunked MLP) are not implemented by the baselines' layer: "
     "set them to 1."),
    (_set("apply_residual_connection_post_layernorm"),
     "apply_residual_connection_post_layernorm would move the residual, which each baseline places itself: set it "
     "to False."),
    (_set("mtp_num_layers"),
     "multi-token prediction (mtp_num_layers) builds stock layers after the baseline's: set mtp_num_layers=None."),
    (_set("multi_latent_attention"),
     "the baselines are built on standard attention (HybridNorm's QKV-norm normalizes its heads): set "
     "multi_latent_attention=False."),
)


def check_single_stream_supported(config: TransformerConfig, scheme: str) -> None:
    """Raise UnsupportedConfigError listing every setting the baseline ``scheme`` cannot honour."""
    fields = {"impl": config.transformer_impl, "cuda_graph_impl": getattr(config, "cuda_graph_impl", "none")}
    problems = _unreviewed_problems(config)
    problems += [message.format(**fields) for refused, message in _SINGLE_STREAM_REFUSALS if refused(config)]
    if config.num_moe_experts:
        problems += _moe_problems(config)
    if problems:
        raise UnsupportedConfigError(f"the {scheme} baseline cannot build this layer:\n- " + "\n- ".join(problems))


def check_supported(config: TransformerConfig, submodules=None, built_for: Optional[str] = None) -> None:
    """Raise UnsupportedConfigError listing every unsupported setting (of the spec and modules, when given)."""
    problems = _problems(config) + _built_for_problems(config, built_for)
    if submodules is not None:
        problems += _spec_problems(config, submodules)
    if problems:
        raise UnsupportedConfigError(
            "SiameseNorm cannot build this layer:\n- " + "\n- ".join(problems)
        )
