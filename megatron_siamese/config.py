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
    """The C++/CUDA extension's fused dual-norm / dual-residual ops: None where it has kernels for the
    device, True insists (failing with the reason), False runs the PyTorch composition. Without this
    field (a plain TransformerConfig, e.g. Megatron-LM's) MEGATRON_SIAMESE_FUSED_OPS=1/0 decides."""

    siamese_boundary_ops: Optional[bool] = None
    """Join a layer's sublayers with the fused boundary ops (7 passes over the tokens per sublayer forward
    instead of 10, the same function; docs/kernels.md): None wherever the fused ops run, True the same
    but fails where they cannot, False never. Without this field MEGATRON_SIAMESE_BOUNDARY_OPS=1/0 decides."""

    siamese_input_norm: bool = True
    """The sublayer's InputNorm: False is the paper's ablation, each sublayer seeing ``PostNorm(x) + PreNorm(y)``
    itself (the hybrid variant's attention side has no InputNorm anyway)."""

    siamese_depth_scale: bool = True
    """The X stream's depth scale ``c = sqrt(2 L)``: False is the ablation ``x = u + z``."""

    mix_ln_alpha: float = 0.25
    """Mix-LN (``mixln``): the first ``floor(mix_ln_alpha * num_layers)`` layers are Post-Norm (the paper's alpha)."""

    hybridnorm_star: bool = False
    """HybridNorm (``hybridnorm``): the first layer Pre-Norm (same QKV-norm), the paper's HybridNorm*."""


@dataclass
class SiameseTransformerConfig(SiameseOptions, TransformerConfig):
    """TransformerConfig plus SiameseNorm's options."""


@dataclass
class SiameseMLATransformerConfig(SiameseOptions, MLATransformerConfig):
    """MLATransformerConfig (GPTModel asks for this class under multi-latent attention) plus SiameseNorm's."""


def siamese_config_class(multi_latent_attention: bool) -> type:
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
    return _requested(config, "siamese_fused_ops", FUSED_OPS_ENV)


def boundary_ops_requested(config: TransformerConfig) -> Optional[bool]:
    return _requested(config, "siamese_boundary_ops", BOUNDARY_OPS_ENV)
