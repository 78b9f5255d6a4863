"""SiameseNorm's switch on top of Megatron's TransformerConfig."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

FUSED_OPS_ENV = "MEGATRON_SIAMESE_FUSED_OPS"
BOUNDARY_OPS_ENV = "MEGATRON_SIAMESE_BOUNDARY_OPS"


@dataclass
class SiameseOptions:
    """SiameseNorm's options, and the baselines' (a plain TransformerConfig works too: every field
    below then takes its default). Mixed into Megatron's config classes below."""

    siamese_fused_ops: Optional[bool] = None
    """Use the fused dual-norm / dual-residual ops of the C++/CUDA extension: None picks them
    wherever the extension provides kernels for the tensors' device, True insists (and fails
    with the reason when it cannot), False always runs the PyTorch composition. Without this
    field (a plain TransformerConfig, e.g. from Megatron-LM) MEGATRON_SIAMESE_FUSED_OPS=1/0
    decides."""

    siamese_boundary_ops: Optional[bool] = None
    """Join a layer's two sublayers with the fused boundary ops (entry_norm, residual_dual_norm,
    dual_residual: 7 passes over the tokens per sublayer forward instead of 10; docs/kernels.md)
    instead of a dual_norm and a dual_residual per sublayer: None uses them wherever the fused
    ops run (CPU and CUDA; their CUDA kernels passed on an H200, 2026-12-04), True the same but
    fails where they cannot, False never. Both compute the same function. Without this
    field MEGATRON_SIAMESE_BOUNDARY_OPS=1/0 decides."""

    siamese_input_norm: bool = True
    """The SiameseNorm sublayer's InputNorm: False is the paper's component-study ablation, in
    which each sublayer sees ``PostNorm(x) + PreNorm(y)`` itself (the layer builds no InputNorm;
    the hybrid variant's attention side has none anyway)."""

    siamese_depth_scale: bool = True
    """The X stream's depth scale ``c = sqrt(2 L)``: False is the ablation ``x = u + z``."""

    mix_ln_alpha: float = 0.25
    """Mix-LN (scheme ``mixln``): the first ``floor(mix_ln_alpha * num_layers)`` layers, by global
    layer number, are Post-Norm, the rest Pre-Norm (the Mix-LN paper's alpha, 0.25 there)."""

    hybridnorm_star: bool = False
    """HybridNorm (scheme ``hybridnorm``): make the first layer Pre-Norm (with the same QKV-norm),
    the HybridNorm paper's HybridNorm*."""


@dataclass
class SiameseTransformerConfig(SiameseOptions, TransformerConfig):
    """TransformerConfig plus SiameseNorm's options."""


@dataclass
class SiameseMLATransformerConfig(SiameseOptions, MLATransformerConfig):
    """Megatron's MLATransformerConfig (multi-latent attention: GPTModel asks for this class) plus
    SiameseNorm's options."""


def siamese_config_class(multi_latent_attention: bool) -> type:
    """The config class for a model with multi-latent attention or without it."""
    return SiameseMLATransformerConfig if multi_latent_attention else SiameseTransformerConfig


def _requested(config: TransformerConfig, field: str, variable: str) -> Optional[bool]:
    """True / False when forced (config field, else environment), None for automatic."""
    requested = getattr(config, field, None)
    if requested is not None:
        return bool(requested)
    value = os.environ.get(variable, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{variable} must be 1, 0 or auto, got {value!r}")


def fused_ops_requested(config: TransformerConfig) -> Optional[bool]:
    """The fused ops: True / False when forced (config field, else environment), None for automatic."""
    return _requested(config, "siamese_fused_ops", FUSED_OPS_ENV)


def boundary_ops_requested(config: TransformerConfig) -> Optional[bool]:
    """The boundary ops: True / False when forced (config field, else environment), None for automatic."""
    return _requested(config, "siamese_boundary_ops", BOUNDARY_OPS_ENV)
