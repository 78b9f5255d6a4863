"""Residual schemes, and stock Megatron ``GPTModel`` / ``HybridModel`` chunks built with them.

``SCHEMES`` names the block specs that train, the check and the tests build models from: ``siamese`` (Python
API), ``siamese-layer`` (the ``--spec`` object Megatron-LM names), ``siamese-hybrid``, Megatron's stock ``pre``,
and the single-stream baselines ``post``, ``hybridnorm``, ``mixln`` (local modules only).
``build_model_chunks`` builds this rank's ``GPTModel`` or ``HybridModel`` chunks. docs/research.md, "The baselines".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Dict, List, Optional

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_siamese.hybrid_pattern import HybridPattern, hybrid_pattern
from megatron_siamese.model_names import MODEL_CLASSES, SCHEME_NAMES
from megatron_siamese.norms import TorchNorm
from megatron_siamese.single_stream import get_single_stream_block_spec
from megatron_siamese.specs import (
    get_mtp_block_spec,
    get_siamese_block_spec,
    siamese_layer_spec,
    siamese_moe_layer_spec,
    stock_decoder_layers,
    uses_transformer_engine,
)


def get_pre_norm_block_spec(config: TransformerConfig, vp_stage: Optional[int] = None):
    """Megatron's stock Pre-Norm decoder block as Megatron builds it for ``config`` (local: SP-capable norms)."""
    use_te = uses_transformer_engine(config, None)
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TransformerBlockSubmodules(layer_specs=stock_decoder_layers(config, True, vp_stage=vp_stage),
                                          layer_norm=TENorm)
    return TransformerBlockSubmodules(layer_specs=stock_decoder_layers(config, False, vp_stage=vp_stage),
                                      layer_norm=TorchNorm)


@dataclass(frozen=True)
class Scheme:
    """A residual scheme: its block spec, and the TransformerConfig settings it needs."""

    block_spec: Callable[[TransformerConfig, Optional[int]], object]
    config: Dict[str, object] = field(default_factory=dict)


SCHEMES: Dict[str, Scheme] = {
    "siamese": Scheme(get_siamese_block_spec),
    "siamese-layer": Scheme(lambda config, vp_stage=None: siamese_moe_layer_spec if config.num_moe_experts
                            else siamese_layer_spec),
    "siamese-hybrid": Scheme(partial(get_siamese_block_spec, variant="hybrid"), {"qk_layernorm": True}),
    "pre": Scheme(get_pre_norm_block_spec),
    "post": Scheme(partial(get_single_stream_block_spec, scheme="post")),
    # their layers differ in parameters where a scheme varies by depth (Mix-LN, HybridNorm*): per-layer
    # checkpoint keys, as Megatron saves mixed MoE layers
    "hybridnorm": Scheme(partial(get_single_stream_block_spec, scheme="hybridnorm"),
                         {"qk_layernorm": True, "hetereogenous_dist_checkpoint": True}),
    "mixln": Scheme(partial(get_single_stream_block_spec, scheme="mixln"), {"hetereogenous_dist_checkpoint": True}),
}
# the command line offers model_names.SCHEME_NAMES without importing this module
assert tuple(SCHEMES) == SCHEME_NAMES, f"model_names.SCHEME_NAMES {SCHEME_NAMES} != SCHEMES {tuple(SCHEMES)}"


def scheme(name: str) -> Scheme:
    if name not in SCHEMES:
        raise ValueError(f"unknown residual scheme {name!r}; choose one of {', '.join(SCHEMES)}")
    return SCHEMES[name]


def _per_virtual_stage(build: Callable[..., object], **common) -> list:
    """``build(**common, vp_stage=..., pre_process=..., post_process=...)`` for each of this rank's virtual stages."""
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
        return gpt_model(config, block_spec(config, vp_stage), vp_stage=vp_stage, **kwargs)

    return _per_virtual_stage(gpt, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                              position_embedding_type=position_embedding_type,
                              share_embeddings_and_output_weights=share_embeddings_and_output_weights)


def gpt_model(config: TransformerConfig, layer_spec, vp_stage: Optional[int] = None, **kwargs) -> GPTModel:
    """A GPTModel of ``layer_spec`` with the MTP block Megatron-LM builds beside it; ``kwargs``: GPTModel's."""
    model = GPTModel(config=config, transformer_layer_spec=layer_spec, vp_stage=vp_stage,
                     mtp_block_spec=get_mtp_block_spec(config, uses_transformer_engine(config, None), vp_stage),
                     **kwargs)
    return without_unused_output_weight(model)


def without_unused_output_weight(model: GPTModel) -> GPTModel:
    """``model`` without the output layer's weight where it never reads it (a last stage with MTP and tied
    embeddings): Megatron allocates it anyway and its checkpoint code asserts it absent (docs/parallelism.md)."""
    if (getattr(model, "mtp_process", False) and model.post_process and not model.pre_process
            and model.share_embeddings_and_output_weights and model.output_layer.weight is not None):
        del model.output_layer.weight
        model.output_layer.register_parameter("weight", None)
    return model


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
