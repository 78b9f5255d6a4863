"""The core attention of the package's local-module specs, where Transformer Engine's is absent.

Megatron's local ``DotProductAttention`` (softmax(Q K^T / sqrt(d)) V, unfused) assumes one head
size for queries, keys and values (``kv_channels``). Multi-latent attention hands its core
attention keys of ``qk_head_dim + qk_pos_emb_head_dim`` and values of ``v_head_dim`` per head, as
``k_channels`` / ``v_channels``, which Transformer Engine's core attention takes and Megatron's
local one refuses ("unexpected keyword argument 'k_channels'", megatron-core 0.16.1 and 0.19.2).
``LocalCoreAttention`` is Megatron's own with those sizes: the scores take whatever head size Q
and K carry, the output is ``v_channels`` per head. Without them it is Megatron's module, unchanged.
"""

from __future__ import annotations

import math
from typing import Optional

from megatron.core.transformer.dot_product_attention import DotProductAttention


class LocalCoreAttention(DotProductAttention):
    """Megatron's local core attention with K and V head sizes of their own (``k_channels``,
    ``v_channels``, as MLA passes them); the softmax scale is MLA's own (``softmax_scale``) or
    ``1 / sqrt(k_channels)``."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None, **kwargs):
        super().__init__(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                         attention_type=attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, **kwargs)
        if softmax_scale is None and k_channels is not None:
            self.softmax_scale = 1.0 / math.sqrt(k_channels)
            if self.config.apply_query_key_layer_scaling:  # as Megatron's own does
                self.softmax_scale /= max(1, layer_number)
        if v_channels is not None:  # the output: v_channels per head of this rank
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
