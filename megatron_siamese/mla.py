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
"""

from __future__ import annotations

import torch

from megatron.core.post_training.modelopt.layers import Linear as DuplicatedLinear
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

DOWN_PROJECTIONS = ("linear_q_down_proj", "linear_kv_down_proj")


class LocalMLASelfAttention(MLASelfAttention):
    """``MLASelfAttention`` whose duplicated down projections (``DuplicatedLinear`` in its spec)
    are initialized by ``config.init_method``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.config.perform_initialization:
            return
        for name in DOWN_PROJECTIONS:
            projection = getattr(self, name, None)
            if isinstance(projection, DuplicatedLinear):
                with torch.no_grad():
                    self.config.init_method(projection.weight)
