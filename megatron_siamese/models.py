"""Residual schemes, and stock Megatron ``GPTModel`` / ``HybridModel`` chunks built with them.

``SCHEMES`` names the block specs that the trainer, the correctness check and the tests
build models from:

* ``siamese``: SiameseNorm via the Python API (``get_siamese_block_spec``);
* ``siamese-layer``: SiameseNorm via the layer spec object Megatron-LM's ``--spec`` names
  (the last layer merges the streams, the final norm is single-stream);
* ``siamese-hybrid``: the authors' hybrid variant (Python API, local modules, QK-norm);
* ``pre``: Megatron's stock Pre-Norm ``TransformerLayer`` from ``get_gpt_layer_local_spec``
  (with ``num_moe_experts``, Megatron's decoder block spec: dense and MoE layers),
  with its norms built as ``TorchNorm`` (the same math as torch's LayerNorm/RMSNorm, but
  usable under sequence parallelism without apex);
* ``post``: Post-Norm on Megatron's ``TransformerLayer`` (``post_norm.py``).

``build_model_chunks`` builds a ``GPTModel`` (any scheme) or a ``HybridModel`` (SiameseNorm,
``hybrid.py``, megatron-core >= 0.19) for this rank's pipeline and virtual stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Dict, List, Optional

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_siamese.hybrid_pattern import HybridPattern, hybrid_pattern
from megatron_siamese.model_names import MODEL_CLASSES, SCHEME_NAMES
from megatron_siamese.norms import TorchNorm
from megatron_siamese.post_norm import get_post_norm_block_spec
from megatron_siamese.specs import get_siamese_block_spec, siamese_layer_spec


def get_pre_norm_block_spec(config: TransformerConfig, vp_stage: Optional[int] = None):
    """Megatron's stock Pre-Norm layer (local modules) with SP-capable norms; with
    ``num_moe_experts``, Megatron's decoder block spec (dense and MoE layers per ``moe_layer_freq``)."""
    if config.num_moe_experts is None:
        layer_specs = [get_gpt_layer_local_spec(normalization=config.normalization)]
        layer_specs *= get_num_layers_to_build(config, vp_stage=vp_stage)
    else:
        layer_specs = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                 normalization=config.normalization, vp_stage=vp_stage).layer_specs
    for layer_spec in layer_specs:
        layer_spec.submodules.input_layernorm = TorchNorm
        layer_spec.submodules.pre_mlp_layernorm = TorchNorm
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=TorchNorm)


@dataclass(frozen=True)
class Scheme:
    """A residual scheme: its block spec, and the TransformerConfig settings it needs."""

    block_spec: Callable[[TransformerConfig, Optional[int]], object]
    config: Dict[str, object] = field(default_factory=dict)


SCHEMES: Dict[str, Scheme] = {
    "siamese": Scheme(get_siamese_block_spec),
    "siamese-layer": Scheme(lambda config, vp_stage=None: siamese_layer_spec),
    "siamese-hybrid": Scheme(partial(get_siamese_block_spec, variant="hybrid"), {"qk_layernorm": True}),
    "pre": Scheme(get_pre_norm_block_spec),
    "post": Scheme(get_post_norm_block_spec),
}
# the command line offers model_names.SCHEME_NAMES without importing this module
assert tuple(SCHEMES) == SCHEME_NAMES, f"model_names.SCHEME_NAMES {SCHEME_NAMES} != SCHEMES {tuple(SCHEMES)}"


def scheme(name: str) -> Scheme:
    if name not in SCHEMES:
        raise ValueError(f"unknown residual scheme {name!r}; choose one of {', '.join(SCHEMES)}")
    return SCHEMES[name]


def _per_virtual_stage(build: Callable[..., object], **common) -> list:
    """``build(**common, vp_stage=..., pre_process=..., post_process=...)`` for each of this rank's
    virtual pipeline stages (one chunk without virtual stages)."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunks.append(build(
            **common,
            vp_stage=stage,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
        ))
    return chunks


def build_gpt_chunks(
    config: TransformerConfig,
    norm: str,
    vocab_size: int,
    max_sequence_length: int,
    position_embedding_type: str = "rope",
    share_embeddings_and_output_weights: bool = True,
) -> List[GPTModel]:
    """This rank's GPTModel chunks with scheme ``norm``: one per virtual pipeline stage."""
    block_spec = scheme(norm).block_spec

    def gpt(vp_stage, **kwargs):
        return GPTModel(transformer_layer_spec=block_spec(config, vp_stage), vp_stage=vp_stage, **kwargs)

    return _per_virtual_stage(gpt, config=config, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                              position_embedding_type=position_embedding_type,
                              share_embeddings_and_output_weights=share_embeddings_and_output_weights)


def build_hybrid_chunks(
    config: TransformerConfig,
    norm: str,
    pattern: str,
    vocab_size: int,
    max_sequence_length: int,
    position_embedding_type: str = "rope",
    share_embeddings_and_output_weights: bool = True,
) -> list:
    """This rank's SiameseNorm HybridModel chunks for ``pattern`` (cut into pipeline stages here
    when it has no '|' of its own)."""
    if norm != "siamese":
        raise ValueError(f"HybridModel is built with SiameseNorm layers only (norm='siamese'), got norm={norm!r}")
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_siamese.hybrid import siamese_hybrid_stack_spec, siamese_hybrid_te_stack_spec

    spec = siamese_hybrid_te_stack_spec if config.transformer_impl == "transformer_engine" else siamese_hybrid_stack_spec
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    staged = HybridPattern(pattern).staged(config.pipeline_model_parallel_size * (vpp or 1))
    return _per_virtual_stage(HybridModel, config=config, hybrid_stack_spec=spec, vocab_size=vocab_size,
                              max_sequence_length=max_sequence_length, hybrid_layer_pattern=staged,
                              position_embedding_type=position_embedding_type,
                              share_embeddings_and_output_weights=share_embeddings_and_output_weights)


def build_model_chunks(config: TransformerConfig, settings, vocab_size: int) -> list:
    """This rank's chunks of the model ``settings`` (runtime.settings.ModelSettings) describe."""
    common = (vocab_size, settings.seq_length, settings.position_embedding_type,
              settings.share_embeddings_and_output_weights)
    if settings.model == "gpt":
        return build_gpt_chunks(config, settings.norm, *common)
    if settings.model == "hybrid":
        return build_hybrid_chunks(config, settings.norm, hybrid_pattern(settings).text, *common)
    raise ValueError(f"model must be one of {MODEL_CLASSES}, got {settings.model!r}")
