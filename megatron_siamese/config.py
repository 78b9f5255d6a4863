"""SiameseNorm's switches on top of Megatron's TransformerConfig."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import TransformerConfig

FUSED_OPS_ENV = "MEGATRON_SIAMESE_FUSED_OPS"
VARIANTS = ("standard", "hybrid")

# the activation-recompute presets our runs and checks use, as TransformerConfig fields
RECOMPUTE_PRESETS = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective", recompute_modules=["layernorm", "mlp"]),
}


def recompute_options(preset: str) -> dict:
    """TransformerConfig keyword arguments for one of RECOMPUTE_PRESETS."""
    if preset not in RECOMPUTE_PRESETS:
        raise ValueError(f"recompute must be one of {tuple(RECOMPUTE_PRESETS)}, got {preset!r}")
    return dict(RECOMPUTE_PRESETS[preset])


@dataclass
class SiameseTransformerConfig(TransformerConfig):
    """TransformerConfig plus SiameseNorm options (a plain TransformerConfig works too)."""

    siamese_fused_ops: Optional[bool] = None
    """Use the fused dual-norm / dual-residual ops of the C++/CUDA extension: None picks them
    whenever the extension provides kernels for this device, True insists (and fails with the
    reason when it cannot), False always runs the PyTorch composition. Without this field
    (a plain TransformerConfig, e.g. from Megatron-LM) MEGATRON_SIAMESE_FUSED_OPS=1/0 decides."""

    siamese_variant: str = "standard"
    """"standard" (the paper's block) or "hybrid" (the authors' OLMo variant: per-channel
    scale and QK-norm on the attention side, reference/functional.py). The hybrid variant
    needs qk_layernorm=True, which this config sets for it."""

    def __post_init__(self):
        if self.siamese_variant not in VARIANTS:
            raise ValueError(f"siamese_variant must be one of {VARIANTS}, got {self.siamese_variant!r}")
        if self.siamese_variant == "hybrid":
            self.qk_layernorm = True
        super().__post_init__()


def fused_ops_requested(config: TransformerConfig) -> Optional[bool]:
    """True / False when forced (config field, else environment), None for automatic."""
    requested = getattr(config, "siamese_fused_ops", None)
    if requested is not None:
        return bool(requested)
    value = os.environ.get(FUSED_OPS_ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{FUSED_OPS_ENV} must be 1, 0 or auto, got {value!r}")
