"""Multi-latent attention on Megatron's local modules, its down projections duplicated over TP as TE's spec
builds them. Megatron's local spec makes them column-parallel, and the decoupled RoPE key's gradient is then
never summed over TP (stock local MLA at TP2: gradients 10-30% off one rank's). Duplicated projections need SP
to have their gradients summed, so MLA under TP needs SP. Megatron's duplicated ``Linear`` ignores
``init_method``: initialized here as Megatron's other linears. docs/design.md, "Multi-latent attention".
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.core.post_training.modelopt.layers import Linear as DuplicatedLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron_siamese.support import UnsupportedConfigError

DOWN_PROJECTIONS = ("linear_q_down_proj", "linear_kv_down_proj")


class LocalMLASelfAttention(MLASelfAttention):
    """``MLASelfAttention`` whose duplicated down projections (``DuplicatedLinear`` in its spec)
    are initialized by ``config.init_method``."""

    def __init__(self, config, submodules, *args, **kwargs):
        if config.q_lora_rank is None:
            if config.qk_layernorm and _normalizes_direct_queries():
                raise UnsupportedConfigError(
                    "multi-latent attention with qk_layernorm and without q_lora_rank: megatron-core >= 0.19 "
                    "normalizes the input of the direct query projection in a Transformer Engine fused norm+linear, "
                    "which Megatron's local modules have no counterpart for. Set q_lora_rank (--q-lora-rank), or "
                    "leave out qk_layernorm, or build the Transformer Engine spec (on a GPU).")
            # no query latent to normalize (0.16 would build a norm there, unused)
            submodules = dataclasses.replace(submodules, q_layernorm=IdentityOp)
        super().__init__(config, submodules, *args, **kwargs)
        if not self.config.perform_initialization:
            return
        for name in DOWN_PROJECTIONS:
            projection = getattr(self, name, None)
            if isinstance(projection, DuplicatedLinear):
                with torch.no_grad():
                    self.config.init_method(projection.weight)


def _normalizes_direct_queries() -> bool:
    """Whether this megatron-core fuses a query norm into MLA's direct query projection (0.19's
    QK-norm resolver; 0.16 has none)."""
    try:
        import megatron.core.transformer.mla_qk_norm_config  # noqa: F401
    except ImportError:
        return False
    return True
