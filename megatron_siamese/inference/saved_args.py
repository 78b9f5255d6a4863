"""The model a checkpoint of Megatron-LM's loop describes, from the ``args`` it stores (every flag of the
run, ours included). One without ``norm`` was not written by our loop and is not guessed at, unless its
``--spec`` names our layer object, which names the scheme."""

from __future__ import annotations

from typing import Optional

from megatron_siamese.runtime.registry import definitions
from megatron_siamese.runtime.settings import ModelSettings

# the layer object Megatron-LM's --spec names for a scheme (docs/megatron-lm.md)
SPEC_SCHEMES = {("megatron_siamese.specs", "siamese_layer_spec"): "siamese-layer",
                ("megatron_siamese.specs", "siamese_moe_layer_spec"): "siamese-layer",
                ("megatron_siamese.hybrid", "siamese_hybrid_stack_spec"): "siamese"}
# ModelSettings fields that Megatron-LM's args name otherwise (the rest share their names)
RENAMED = {"gated_linear_unit": "swiglu", "zero_centered_gamma": "apply_layernorm_1p",
           "num_moe_experts": "num_experts", "fused_ops": "siamese_fused_ops", "boundary_ops": "siamese_boundary_ops"}


def scheme_of(args) -> Optional[str]:
    norm = getattr(args, "norm", None)
    if norm is not None:
        return norm
    return SPEC_SCHEMES.get(tuple(getattr(args, "spec", None) or ()))


def settings_from_args(args) -> Optional[ModelSettings]:
    """The ModelSettings of a checkpoint whose ``args`` Megatron-LM's loop saved (None: no scheme named)."""
    norm = scheme_of(args)
    if norm is None:
        return None
    derived = dict(
        norm=norm,
        model="hybrid" if getattr(args, "hybrid_layer_pattern", None) else "gpt",
        num_query_groups=args.num_query_groups if getattr(args, "group_query_attention", False) else None,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        moe_layer_freq=str(getattr(args, "moe_layer_freq", 1)),
        dtype="bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32",
    )
    values = {}
    for name in definitions(ModelSettings):
        argument = RENAMED.get(name, name)
        if name in derived:
            values[name] = derived[name]
        elif hasattr(args, argument):
            values[name] = getattr(args, argument)
    return ModelSettings(**values)
