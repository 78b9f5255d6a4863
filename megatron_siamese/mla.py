"""Multi-latent attention on Megatron's local modules: Megatron's ``MLASelfAttention`` with its
query and key/value down projections duplicated over tensor parallelism, as Transformer Engine's
spec builds them (``TELinear``, ``parallel_mode="duplicated"``).

Megatron's local spec makes those projections ``ColumnParallelLinear``s whose outputs MLA
all-gathers over TP. Every rank then holds the whole decoupled RoPE key ``k_pos_emb`` and uses it
for its own heads only, but the gather's backward takes this rank's slice of that partial
gradient: the key's gradient is never summed over TP (measured on CPU ranks: stock MLA at tp2, with
or without SP, has gradients 10-30% off the single rank's, megatron-core 0.16.1 and 0.19.2).
Duplicated, the projections run on this rank's tokens (sequence parallelism), MLA gathers
``k_pos_emb`` over the sequence (its backward a reduce-scatter: the sum), and their own gradients
are summed over TP with the norms' (``sequence_parallel``): what TE's spec computes, on local
modules. Without sequence parallelism a duplicated projection's gradient would stay partial: MLA
under TP needs SP (``runtime/divisibility.py`` refuses it otherwise).

Megatron's duplicated local ``Linear`` (``post_training.modelopt.layers``) is a plain
``torch.nn.Linear`` that ignores ``init_method``; ``LocalMLASelfAttention`` initializes the
projections as Megatron's other linears are (``config.init_method``, the same on every TP rank).
Without ``q_lora_rank`` queries are projected directly and there is no query latent to normalize:
the query latent norm slot is then left empty (0.16 builds a norm there unused). With
``qk_layernorm`` megatron-core 0.19 then normalizes the query projection's input inside a
Transformer Engine fused norm+linear, which the local modules have no counterpart for: refused.
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
