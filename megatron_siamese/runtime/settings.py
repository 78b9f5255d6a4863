"""What a model is, apart from how it is split over ranks: plain data, no torch or Megatron import.

Each field is the setting's one definition (``runtime/registry.py``), validated in the launching
process before any rank starts; ``runtime/gpt.py`` turns them into Megatron's TransformerConfig.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Dict, List, Optional

from megatron_siamese.model_names import MODEL_CLASSES, SCHEME_NAMES
from megatron_siamese.runtime.registry import Switch, definitions, setting

DTYPE_NAMES = ("fp32", "bf16")  # runtime/gpt.py's DTYPES
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("rope", "learned_absolute")
TRANSFORMER_IMPLS = ("local", "transformer_engine")
FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")

ROPE_TYPES = ("rope", "yarn")  # Megatron-LM's --rope-type (MLA's RoPE)
MLA_SETTINGS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
                "rotary_scaling_factor")  # MLATransformerConfig's fields, set when multi_latent_attention
MOE_DISPATCHERS = ("allgather", "alltoall", "flex")  # flex (DeepEP / HybridEP) is offered so refusing it on CPU says why
MOE_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")

MODEL = "model"  # the argparse groups of these settings
MOE = "mixture of experts"
PRECISION = "precision and kernels"


def _moe_layer_problem(text: str) -> Optional[str]:
    try:
        moe_layer_freq(text)
    except ValueError as error:
        return f"--moe-layer-freq {text!r}: {error}"
    return None


def moe_layer_freq(text: str):
    """``--moe-layer-freq`` as Megatron-LM reads it: an int N (every N-th layer from the first is
    an MoE layer), or a 0/1 list, written as a list or Megatron-LM's expression
    (``([1]*3+[0])*2``), evaluated here without ``eval``."""
    import ast

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [value(item) for item in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError("expected an int or a list of 0/1 such as [1,0,1,0] or ([1]*3+[0])*2")

    try:
        parsed = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, TypeError):
        raise ValueError("expected an int or a list of 0/1 such as [1,0,1,0] or ([1]*3+[0])*2") from None
    if isinstance(parsed, int):
        if parsed < 1:
            raise ValueError("an MoE layer every N layers needs N >= 1")
        return parsed
    if not parsed or any(item not in (0, 1) for item in parsed):
        raise ValueError("a pattern lists one 0 (dense) or 1 (MoE) per layer")
    return parsed


def _fraction_problem(alpha: float) -> Optional[str]:
    return None if alpha <= 1.0 else f"--mix-ln-alpha is a share of the layers, at most 1 (got {alpha:g})"


def _no_fp16(dtype: str) -> Optional[str]:
    if dtype == "fp16":
        return ("--dtype fp16 is not supported (Megatron's fp16 needs a loss scaler, which the check's step does not run): "
                "use --bf16 or --dtype fp32")
    return None


@dataclass(frozen=True)
class ModelSettings:
    """A GPT's shape, residual scheme and numerics: everything but the layout and the data."""

    norm: str = setting(
        "siamese", group=MODEL, flag="--norm", choices=SCHEME_NAMES,
        help="residual scheme: siamese (SiameseNorm), siamese-layer (the Megatron-LM --spec layer object), "
             "siamese-hybrid (the authors' QK-norm variant), pre (Megatron's Pre-Norm layer), post (Post-Norm), "
             "hybridnorm (HybridNorm: QKV-norm in attention, Post-Norm on the FFN side), mixln (Mix-LN: Post-Norm "
             "in the first layers, Pre-Norm in the rest)")
    siamese_input_norm: bool = setting(
        True, group=MODEL, flag="--siamese-input-norm", action=argparse.BooleanOptionalAction,
        config="siamese_input_norm",
        help="SiameseNorm's InputNorm before each sublayer (--no-siamese-input-norm: the paper's component-study "
             "ablation; SiameseNorm schemes only)")
    siamese_depth_scale: bool = setting(
        True, group=MODEL, flag="--siamese-depth-scale", action=argparse.BooleanOptionalAction,
        config="siamese_depth_scale",
        help="SiameseNorm's depth scale x = u + z / sqrt(2L) (--no-siamese-depth-scale: the ablation x = u + z; "
             "SiameseNorm schemes only)")
    mix_ln_alpha: float = setting(
        0.25, group=MODEL, flag="--mix-ln-alpha", minimum=0.0, check=_fraction_problem, config="mix_ln_alpha",
        metavar="ALPHA", help="--norm mixln: the first floor(ALPHA x layers) layers are Post-Norm, the rest Pre-Norm "
                              "(the Mix-LN paper's 0.25)")
    hybridnorm_star: bool = setting(
        False, group=MODEL, flag="--hybridnorm-star", action="store_true", config="hybridnorm_star",
        help="--norm hybridnorm: the first layer Pre-Norm (with QKV-norm), the HybridNorm paper's HybridNorm*")
    model: str = setting(
        "gpt", group=MODEL, flag="--model", choices=MODEL_CLASSES,
        help="gpt (GPTModel) or hybrid (HybridModel, megatron-core >= 0.19, SiameseNorm only)")
    hybrid_layer_pattern: Optional[str] = setting(
        None, group=MODEL, flag="--hybrid-layer-pattern", metavar="PATTERN",
        help="HybridModel layers, e.g. '*-*-' ('*' attention, '-' MLP; default: '*-' per --num-layers)")
    num_layers: int = setting(4, group=MODEL, flag="--num-layers", minimum=1, help="transformer layers (GPT blocks)")
    hidden_size: int = setting(128, group=MODEL, flag="--hidden-size", minimum=1, config="hidden_size",
                               help="hidden size")
    num_attention_heads: int = setting(4, group=MODEL, flag="--num-attention-heads", minimum=1,
                                       config="num_attention_heads", help="attention heads")
    num_query_groups: Optional[int] = setting(None, group=MODEL, flag="--num-query-groups", minimum=1,
                                              config="num_query_groups",
                                              help="key/value head groups (GQA; default: one per head)")
    # 4 * hidden_size when None (runtime/gpt.py)
    ffn_hidden_size: Optional[int] = setting(None, group=MODEL, flag="--ffn-hidden-size", minimum=1,
                                             help="MLP width (default: 4 x hidden)")
    seq_length: int = setting(128, group=MODEL, flag="--seq-length", minimum=1, help="tokens per sequence")
    normalization: str = setting("RMSNorm", group=MODEL, flag="--normalization", choices=NORMALIZATIONS,
                                 config="normalization", help="norm kind")
    position_embedding_type: str = setting("rope", group=MODEL, flag="--position-embedding-type",
                                           choices=POSITION_EMBEDDINGS, help="position embedding")
    gated_linear_unit: bool = setting(True, group=MODEL, flag="--swiglu", action=argparse.BooleanOptionalAction,
                                      config="gated_linear_unit", help="SwiGLU MLP (--no-swiglu: GELU)")
    add_bias_linear: bool = setting(
        False, group=MODEL, flag="--add-bias-linear", action="store_true", config="add_bias_linear",
        help="biases in the linear layers",
        switches=(Switch(("--disable-bias-linear",), "no biases (Megatron-LM's name)", action="store_false"),))
    qk_layernorm: bool = setting(False, group=MODEL, flag="--qk-layernorm", action="store_true", config="qk_layernorm",
                                 help="normalize queries and keys per head (Qwen3 / OLMo 2 QK-norm; the "
                                      "siamese-hybrid scheme always has it)")
    multi_latent_attention: bool = setting(
        False, group=MODEL, flag="--multi-latent-attention", action="store_true", config="multi_latent_attention",
        help="multi-latent attention (DeepSeek's MLA: Megatron's MLASelfAttention, its queries and keys/values "
             "through low-rank latents with their own norms under --qk-layernorm, RoPE on a part of each head)")
    q_lora_rank: Optional[int] = setting(None, group=MODEL, flag="--q-lora-rank", minimum=1,
                                         help="MLA: the queries' latent rank (unset: queries projected directly)")
    kv_lora_rank: int = setting(32, group=MODEL, flag="--kv-lora-rank", minimum=1,
                                help="MLA: the keys' and values' latent rank")
    qk_head_dim: int = setting(128, group=MODEL, flag="--qk-head-dim", minimum=1,
                               help="MLA: each query and key head's part without RoPE")
    qk_pos_emb_head_dim: int = setting(64, group=MODEL, flag="--qk-pos-emb-head-dim", minimum=1,
                                       help="MLA: each query and key head's RoPE part (the keys' shared by every head)")
    v_head_dim: int = setting(128, group=MODEL, flag="--v-head-dim", minimum=1, help="MLA: each value head's size")
    rope_type: Optional[str] = setting(None, group=MODEL, flag="--rope-type", choices=ROPE_TYPES,
                                       help="MLA's RoPE: rope, or yarn (Megatron's default for MLA when unset)")
    rotary_scaling_factor: float = setting(1.0, group=MODEL, flag="--rotary-scaling-factor", minimum=0.0,
                                           help="MLA with --rope-type yarn: YaRN's scaling factor")
    mtp_num_layers: Optional[int] = setting(
        None, group=MODEL, flag="--mtp-num-layers", minimum=1, config="mtp_num_layers",
        help="multi-token prediction (DeepSeek-V3's MTP): this many Megatron MTP layers after the decoder, on the "
             "last pipeline stage, each predicting one token further (docs/design.md)")
    mtp_loss_scaling_factor: float = setting(
        0.1, group=MODEL, flag="--mtp-loss-scaling-factor", minimum=0.0, config="mtp_loss_scaling_factor",
        resumable=True, help="the MTP losses' weight: their mean times this is added to the LM loss")
    zero_centered_gamma: bool = setting(False, group=MODEL, flag="--apply-layernorm-1p", action="store_true",
                                        config="layernorm_zero_centered_gamma",
                                        help="zero-centred norm weights (gamma = 1 + w)")
    share_embeddings_and_output_weights: bool = setting(
        True, group=MODEL, flag="--untie-embeddings-and-output-weights", action="store_false",
        help="separate input embedding and output layer weights")
    num_moe_experts: Optional[int] = setting(
        None, group=MOE, flag="--num-experts", minimum=1, config="num_moe_experts",
        help="experts per MoE layer (Megatron's MoELayer as the MLP sublayer; unset: dense MLPs)")
    moe_router_topk: int = setting(2, group=MOE, flag="--moe-router-topk", minimum=1, config="moe_router_topk",
                                   help="experts each token is routed to")
    moe_router_pre_softmax: bool = setting(
        False, group=MOE, flag="--moe-router-pre-softmax", action="store_true", config="moe_router_pre_softmax",
        help="softmax over all experts before picking the top k (needed for --moe-router-topk 1)")
    moe_layer_freq: str = setting(
        "1", group=MOE, flag="--moe-layer-freq", check=_moe_layer_problem, metavar="N|PATTERN",
        help="which layers are MoE: every N-th from the first, or one 0/1 per layer ('[1,0,1,0]', '([1]*3+[0])*2')")
    # the MLP width when None (runtime/gpt.py)
    moe_ffn_hidden_size: Optional[int] = setting(None, group=MOE, flag="--moe-ffn-hidden-size", minimum=1,
                                                 help="each expert's MLP width (default: --ffn-hidden-size)")
    moe_shared_expert_intermediate_size: Optional[int] = setting(
        None, group=MOE, flag="--moe-shared-expert-intermediate-size", minimum=1,
        config="moe_shared_expert_intermediate_size", help="width of the shared expert every token also goes through")
    moe_aux_loss_coeff: float = setting(1e-2, group=MOE, flag="--moe-aux-loss-coeff", minimum=0.0,
                                        config="moe_aux_loss_coeff", resumable=True,
                                        help="load-balancing auxiliary loss coefficient")
    moe_z_loss_coeff: Optional[float] = setting(None, group=MOE, flag="--moe-z-loss-coeff", minimum=0.0,
                                                config="moe_z_loss_coeff", resumable=True,
                                                help="router z-loss coefficient (unset: none)")
    moe_router_load_balancing_type: str = setting(
        "aux_loss", group=MOE, flag="--moe-router-load-balancing-type", choices=MOE_LOAD_BALANCING,
        config="moe_router_load_balancing_type", resumable=True,
        help="how the auxiliary loss balances the experts (Megatron's types)")
    moe_token_dispatcher_type: str = setting(
        "alltoall", group=MOE, flag="--moe-token-dispatcher-type", choices=MOE_DISPATCHERS,
        config="moe_token_dispatcher_type", resumable=True,
        help="how Megatron moves tokens to the experts' ranks under expert parallelism")
    moe_grouped_gemm: bool = setting(False, group=MOE, flag="--moe-grouped-gemm", action="store_true",
                                     config="moe_grouped_gemm",
                                     help="grouped-GEMM experts (TEGroupedMLP; needs --transformer-impl transformer_engine)")
    init_method_std: float = setting(0.02, group=MODEL, flag="--init-method-std", config="init_method_std",
                                     resumable=True, help="standard deviation of the weight init")
    # fp16 is offered so that refusing it can say why
    dtype: str = setting("fp32", group=PRECISION, flag="--dtype", choices=DTYPE_NAMES + ("fp16",), check=_no_fp16,
                         help="parameter and activation dtype",
                         switches=(Switch(("--bf16",), "same as --dtype bf16", action="store_const", const="bf16"),))
    fused_ops: Optional[bool] = setting(
        None, group=PRECISION, flag="--fused-ops", action=argparse.BooleanOptionalAction, config="siamese_fused_ops", resumable=True,
        help="the fused C++/CUDA dual-norm ops: on, off, or (unset) wherever the extension has kernels")
    boundary_ops: Optional[bool] = setting(
        None, group=PRECISION, flag="--boundary-ops", action=argparse.BooleanOptionalAction,
        config="siamese_boundary_ops", resumable=True,
        help="join each layer's two sublayers with the fused boundary ops (fewer bytes; the same function): on, "
             "off, or (unset) on CPU only, until their CUDA kernels have run on a GPU")
    transformer_impl: str = setting("local", group=PRECISION, flag="--transformer-impl", choices=TRANSFORMER_IMPLS,
                                    config="transformer_impl",
                                    help="Megatron's own modules, or Transformer Engine's GEMMs and attention (GPUs)")
    fp8: Optional[str] = setting(None, group=PRECISION, flag=("--fp8-format", "--fp8"), choices=FP8_FORMATS,
                                 config="fp8", resumable=True, help="Transformer Engine FP8 format")
    fp8_recipe: str = setting("delayed", group=PRECISION, flag="--fp8-recipe", choices=FP8_RECIPES,
                              config="fp8_recipe", resumable=True, help="FP8 scaling recipe, as Megatron names it")

    @property
    def mlp_width(self) -> int:
        """The dense MLP's width as Megatron builds it: --ffn-hidden-size, else 4 x hidden."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def expert_width(self) -> int:
        """Each expert's MLP width: --moe-ffn-hidden-size, else the dense MLP's (Megatron's default)."""
        return self.moe_ffn_hidden_size or self.mlp_width


SIAMESE_SCHEMES = tuple(name for name in SCHEME_NAMES if name.startswith("siamese"))
# the settings one scheme reads, with the schemes that read them (train and check refuse them elsewhere)
SCHEME_SETTINGS = {"siamese_input_norm": SIAMESE_SCHEMES, "siamese_depth_scale": SIAMESE_SCHEMES,
                   "mix_ln_alpha": ("mixln",), "hybridnorm_star": ("hybridnorm",)}


def scheme_setting_problems(settings: ModelSettings, scheme_flag: str = "--norm",
                            spelled: Optional[Dict[str, str]] = None) -> List[str]:
    """A scheme's own settings given another scheme (they would change nothing: train and check).
    ``scheme_flag`` and ``spelled`` (a scheme's name for it) are the command's (check: --spec)."""
    spell = (lambda scheme: (spelled or {}).get(scheme, scheme))
    found = []
    for name, schemes in SCHEME_SETTINGS.items():
        definition, value = definitions(ModelSettings)[name], getattr(settings, name)
        if value == definition.default or settings.norm in schemes:
            continue
        flag = definition.flags[0]
        shown = f"--no-{flag[2:]}" if value is False else flag
        found.append(f"{shown} applies to {scheme_flag} {' / '.join(map(spell, schemes))}, "
                     f"not {scheme_flag} {spell(settings.norm)}: drop it")
    return found


def model_class_problems(settings: ModelSettings) -> List[str]:
    """What the installed megatron-core cannot build of ``settings``' model class (train and check)."""
    if settings.model != "hybrid":
        return []
    from megatron_siamese.versions import installed_megatron_core, release

    if release(installed_megatron_core()) < (0, 19, 0):
        return [f"--model hybrid needs megatron-core >= 0.19 (installed: {installed_megatron_core()}); "
                "use --model gpt here"]
    return []
