"""What a model is, apart from how it is split over ranks: plain data, no torch or Megatron import.

Each field is the setting's one definition (``runtime/registry.py``): its type, default,
flags and help, allowed values, and the TransformerConfig field it sets as it is. The
command line builds its model flags from them and validates them (``training/args.py``) in
the launching process before any rank starts, so a bad flag costs a fraction of a second;
``runtime/gpt.py`` turns them into Megatron's TransformerConfig and model chunks.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import List, Optional

from megatron_siamese.model_names import MODEL_CLASSES, SCHEME_NAMES
from megatron_siamese.runtime.registry import Switch, setting

DTYPE_NAMES = ("fp32", "bf16")  # runtime/gpt.py's DTYPES
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("rope", "learned_absolute")
TRANSFORMER_IMPLS = ("local", "transformer_engine")
FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")

MODEL = "model"  # the argparse groups of these settings
PRECISION = "precision and kernels"


def _no_fp16(dtype: str) -> Optional[str]:
    if dtype == "fp16":
        return ("--dtype fp16 is not supported (Megatron's fp16 needs loss scaling this trainer does not do): "
                "use --bf16 or --dtype fp32")
    return None


@dataclass(frozen=True)
class ModelSettings:
    """A GPT's shape, residual scheme and numerics: everything but the layout and the data."""

    norm: str = setting(
        "siamese", group=MODEL, flag="--norm", choices=SCHEME_NAMES,
        help="residual scheme: siamese (SiameseNorm), siamese-layer (the Megatron-LM --spec layer object), "
             "siamese-hybrid (the authors' QK-norm variant), pre (Megatron's Pre-Norm layer), post (Post-Norm)")
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
    zero_centered_gamma: bool = setting(False, group=MODEL, flag="--apply-layernorm-1p", action="store_true",
                                        config="layernorm_zero_centered_gamma",
                                        help="zero-centred norm weights (gamma = 1 + w)")
    share_embeddings_and_output_weights: bool = setting(
        True, group=MODEL, flag="--untie-embeddings-and-output-weights", action="store_false",
        help="separate input embedding and output layer weights")
    init_method_std: float = setting(0.02, group=MODEL, flag="--init-method-std", config="init_method_std",
                                     resumable=True, help="standard deviation of the weight init")
    # fp16 is offered so that refusing it can say why
    dtype: str = setting("fp32", group=PRECISION, flag="--dtype", choices=DTYPE_NAMES + ("fp16",), check=_no_fp16,
                         help="parameter and activation dtype",
                         switches=(Switch(("--bf16",), "same as --dtype bf16", action="store_const", const="bf16"),))
    fused_ops: Optional[bool] = setting(
        None, group=PRECISION, flag="--fused-ops", action=argparse.BooleanOptionalAction, config="siamese_fused_ops", resumable=True,
        help="the fused C++/CUDA dual-norm ops: on, off, or (unset) wherever the extension has kernels")
    transformer_impl: str = setting("local", group=PRECISION, flag="--transformer-impl", choices=TRANSFORMER_IMPLS,
                                    config="transformer_impl",
                                    help="Megatron's own modules, or Transformer Engine's GEMMs and attention (GPUs)")
    fp8: Optional[str] = setting(None, group=PRECISION, flag=("--fp8-format", "--fp8"), choices=FP8_FORMATS,
                                 config="fp8", resumable=True, help="Transformer Engine FP8 format")
    fp8_recipe: str = setting("delayed", group=PRECISION, flag="--fp8-recipe", choices=FP8_RECIPES,
                              config="fp8_recipe", resumable=True, help="FP8 scaling recipe, as Megatron names it")


def model_class_problems(settings: ModelSettings) -> List[str]:
    """What the installed megatron-core cannot build of ``settings``' model class (train and check)."""
    if settings.model != "hybrid":
        return []
    from megatron_siamese.versions import installed_megatron_core, release

    if release(installed_megatron_core()) < (0, 19, 0):
        return [f"--model hybrid needs megatron-core >= 0.19 (installed: {installed_megatron_core()}); "
                "use --model gpt here"]
    return []
