"""What a model is, apart from how it is split over ranks: plain data, no torch or Megatron import.

The command line validates these (``training/args.py``) in the launching process before any
rank starts, so a bad flag costs a fraction of a second; ``runtime/gpt.py`` turns them into
Megatron's TransformerConfig and model chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_siamese.model_names import MODEL_CLASSES, SCHEME_NAMES

DTYPE_NAMES = ("fp32", "bf16")  # runtime/gpt.py's DTYPES


@dataclass(frozen=True)
class ModelSettings:
    """A GPT's shape, residual scheme and numerics: everything but the layout and the data."""

    norm: str = "siamese"  # a scheme of megatron_siamese.models.SCHEMES
    # "gpt" (GPTModel) or "hybrid" (HybridModel, megatron-core >= 0.19; SiameseNorm only)
    model: str = "gpt"
    # the HybridModel's layers, e.g. "*-*-" or "M*-M*-" (None: "*-" per layer, the GPT's equivalent)
    hybrid_layer_pattern: Optional[str] = None
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None  # 4 * hidden_size when None
    seq_length: int = 128
    normalization: str = "RMSNorm"
    gated_linear_unit: bool = True  # SwiGLU; GELU without
    position_embedding_type: str = "rope"
    share_embeddings_and_output_weights: bool = True
    add_bias_linear: bool = False
    zero_centered_gamma: bool = False
    dtype: str = "fp32"
    fused_ops: Optional[bool] = None  # SiameseTransformerConfig.siamese_fused_ops
    transformer_impl: str = "local"  # or "transformer_engine": TE GEMMs and attention (GPUs)
    fp8: Optional[str] = None  # "hybrid" or "e4m3" with transformer_engine
    fp8_recipe: str = "delayed"
    init_method_std: float = 0.02


