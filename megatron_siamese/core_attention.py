"""The core attention of the package's local-module specs, where Transformer Engine's is absent.

Megatron's local ``DotProductAttention`` assumes one head size for Q, K and V and refuses MLA's
``k_channels`` / ``v_channels``; ``LocalCoreAttention`` is Megatron's own with those sizes (unchanged without).
Under context parallelism it becomes ``ContextParallelCoreAttention``: exact, by all-gathering the CP group's
keys and values (Megatron's local attention refuses CP; TE's needs CUDA). The gathered keys arrive in rank
order, not sequence order: the mask, not the keys, is put in that order. It costs what all-gather attention
costs; it is there to check on CPU everything CP touches outside the attention.
Full story: docs/parallelism.md, "Context parallelism"; docs/design.md, "Multi-latent attention".
"""

from __future__ import annotations

import copy
import math
from typing import Optional

import torch
from torch import Tensor

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_siamese.context_parallel import (
    document_mask,
    document_positions_on_rank,
    gathered_document_positions,
    gathered_positions,
    positions_on_rank,
)
from megatron_siamese.support import UnsupportedConfigError


class LocalCoreAttention(DotProductAttention):
    """Megatron's local core attention with K and V head sizes of their own (as MLA passes them). Under
    context parallelism it builds ``ContextParallelCoreAttention``: spec objects exist before any config."""

    def __new__(cls, config, *args, **kwargs):
        if cls is LocalCoreAttention and config.context_parallel_size > 1:
            cls = ContextParallelCoreAttention
        return super().__new__(cls)

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

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        documents = packed_documents(packed_seq_params)
        positions = torch.arange(query.size(0), device=query.device)
        return self.attend_packed(query, key, value, document_mask(positions, positions, documents), attention_bias)

    def attend_packed(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor, attention_bias) -> Tensor:
        """Packed (THD) queries, keys and values as one sample, ``mask`` honoured whatever the softmax's mask
        type (a causal kernel would ignore it); ``[t, 1, heads x d]`` out, as TE's."""
        softmax = self.scale_mask_softmax
        mask_type, softmax.attn_mask_type = softmax.attn_mask_type, AttnMaskType.padding
        try:
            return DotProductAttention.forward(self, query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask,
                                               attention_bias=attention_bias)
        finally:
            softmax.attn_mask_type = mask_type


def packed_documents(packed_seq_params) -> Tensor:
    """The documents' bounds of a packed (THD) self-attention batch, or a refusal of what the local
    attention does not compute (another format, padded documents, keys unlike the queries)."""
    if packed_seq_params.qkv_format != "thd":
        raise UnsupportedConfigError(f"the local attention takes packed sequences in the thd format, not "
                                     f"{packed_seq_params.qkv_format!r}")
    documents = packed_seq_params.cu_seqlens_q
    others = [packed_seq_params.cu_seqlens_kv, packed_seq_params.cu_seqlens_q_padded,
              packed_seq_params.cu_seqlens_kv_padded]
    if any(other is not None and not torch.equal(other.to(documents.device), documents) for other in others):
        raise UnsupportedConfigError("the local attention takes packed self-attention without padding between "
                                     "documents: cu_seqlens_kv and the padded bounds must equal cu_seqlens_q")
    return documents


class ContextParallelCoreAttention(LocalCoreAttention):
    """``LocalCoreAttention`` under context parallelism: this rank's queries over the gathered keys and values."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str, *args,
                 cp_comm_type: Optional[str] = None, pg_collection=None, **kwargs):
        problem = _unsupported(config, cp_comm_type)
        if problem:
            raise UnsupportedConfigError(f"the local context-parallel attention cannot run this: {problem}")
        # Megatron's module asserts context_parallel_size == 1: built on a copy that says so
        single = copy.copy(config)
        single.context_parallel_size = 1
        super().__init__(single, layer_number, attn_mask_type, attention_type, *args, pg_collection=pg_collection,
                         **kwargs)
        self.config = config
        from megatron.core import parallel_state

        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()
        # the mask is always given (in gathered order): a causal kernel would assume s_query == s_key
        self.scale_mask_softmax.attn_mask_type = AttnMaskType.padding
        self.causal = attn_mask_type == AttnMaskType.causal

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        cp, rank = self.cp_group.size(), self.cp_group.rank()
        key = gather_from_sequence_parallel_region(key.contiguous(), group=self.cp_group)
        value = gather_from_sequence_parallel_region(value.contiguous(), group=self.cp_group)
        if packed_seq_params is not None:  # each document split over the ranks on its own
            documents = packed_documents(packed_seq_params)
            queries = document_positions_on_rank(documents, cp, rank).to(query.device)
            keys = gathered_document_positions(documents, cp).to(query.device)
            return self.attend_packed(query, key, value, document_mask(queries, keys, documents), attention_bias)
        mask = self.gathered_mask(attention_mask, query.size(0) * cp, cp, rank, query.device)
        return super().forward(query, key, value, mask, attention_bias=attention_bias)

    def gathered_mask(self, attention_mask: Optional[Tensor], seq_length: int, cp: int, rank: int,
                      device) -> Optional[Tensor]:
        """The mask of this rank's queries over the gathered keys (True: masked out)."""
        keys = gathered_positions(seq_length, cp).to(device)
        if attention_mask is None:
            if not self.causal:
                return None
            queries = positions_on_rank(seq_length, cp, rank).to(device)
            return (keys[None, :] > queries[:, None])[None, None]
        if attention_mask.size(-2) == seq_length:  # a whole-sequence mask: this rank's query rows
            attention_mask = attention_mask.index_select(-2, positions_on_rank(seq_length, cp, rank).to(device))
        return attention_mask.index_select(-1, keys)


def _unsupported(config, cp_comm_type: Optional[str]) -> Optional[str]:
    """What of ``config`` this attention does not compute (None: it does)."""
    if cp_comm_type not in (None, "p2p", "all_gather"):  # p2p: Megatron's default name for TE's ring
        return (f"cp_comm_type {cp_comm_type!r} (hierarchical a2a/a2a+p2p is Transformer Engine's): leave "
                "--cp-comm-type at p2p or all_gather")
    if getattr(config, "window_size", None) is not None:
        return "sliding-window attention (window_size): the local attention builds its window from local positions"
    if getattr(config, "hybrid_context_parallel", False):
        return "hybrid_context_parallel (Transformer Engine's)"
    return None
