"""Context parallelism's sequence split: which tokens each rank of a CP group holds.

As Megatron (and its RoPE, which must agree) splits it: ``2 cp`` chunks a sequence, rank r holding chunks r and
``2 cp - 1 - r`` so that causal attention's work is balanced. Gathered in rank order the rows are then out of
sequence order; ``gathered_positions`` names their places, so the CP attention masks keys without reordering.
``batch_on_rank`` replaces Megatron's splitter, whose signature changed in 0.19 and which splits no packed (THD)
batch. docs/parallelism.md, "Context parallelism".
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

# the batch's per-token tensors and the dimension their sequence runs along
_SEQUENCE_DIM = {"tokens": 1, "labels": 1, "loss_mask": 1, "position_ids": 1}
_MASK_QUERY_DIM = 2  # attention_mask [b, 1, s_query, s_key]: its query rows are split, its keys kept


def check_divisible(seq_length: int, cp: int) -> None:
    if seq_length % (2 * cp):
        raise ValueError(f"sequence length {seq_length} must be a multiple of 2 x cp = {2 * cp} "
                         "(context parallelism cuts each sequence into 2 cp equal chunks)")


def positions_on_rank(seq_length: int, cp: int, rank: int) -> Tensor:
    """The sequence positions of CP rank ``rank``'s tokens, in the order it holds them: chunk
    ``rank`` then chunk ``2 cp - 1 - rank`` (without CP: every position)."""
    if cp == 1:
        return torch.arange(seq_length)
    check_divisible(seq_length, cp)
    chunk = seq_length // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def gathered_positions(seq_length: int, cp: int) -> Tensor:
    """The sequence position of each row of a tensor all-gathered over the CP group (rank order)."""
    return torch.cat([positions_on_rank(seq_length, cp, rank) for rank in range(cp)])


def document_positions_on_rank(cu_seqlens: Tensor, cp: int, rank: int) -> Tensor:
    """Packed (THD) sequences: the packed positions of CP rank ``rank``'s tokens, each document split on its own
    as TE's THD attention and Megatron's THD RoPE assume."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    uneven = [length for length in lengths if cp > 1 and length % (2 * cp)]
    if uneven:
        raise ValueError(f"packed documents of {uneven} tokens do not cut into 2 x cp = {2 * cp} equal chunks: under "
                         "context parallelism pad each document to a multiple of 2 cp")
    return torch.cat([start + positions_on_rank(length, cp, rank) for start, length in zip(bounds, lengths)])


def gathered_document_positions(cu_seqlens: Tensor, cp: int) -> Tensor:
    """The packed position of each row of a THD tensor all-gathered over the CP group."""
    return torch.cat([document_positions_on_rank(cu_seqlens, cp, rank) for rank in range(cp)])


def document_mask(queries: Tensor, keys: Tensor, cu_seqlens: Tensor) -> Tensor:
    """``[1, 1, q, k]``, True where a query may not attend a key (Megatron's convention): a key of
    another document, or a later one. ``queries``, ``keys``: packed positions."""
    ends = cu_seqlens[1:].to(queries.device)
    query_document = torch.bucketize(queries, ends, right=True)
    key_document = torch.bucketize(keys, ends, right=True)
    return ((query_document[:, None] != key_document[None, :]) | (keys[None, :] > queries[:, None]))[None, None]


def batch_on_rank(batch: Dict[str, Tensor], cp: int, rank: int) -> Dict[str, Tensor]:
    """CP rank ``rank``'s part of a microbatch (of the mask its query rows). Unknown keys are refused: a tensor
    split the wrong way would silently train on other tokens."""
    if cp == 1:
        return batch
    unknown = sorted(set(batch) - set(_SEQUENCE_DIM) - {"attention_mask", "cu_seqlens"})
    if unknown:
        raise ValueError(f"cannot split {unknown} over context-parallel ranks: only {sorted(_SEQUENCE_DIM)} and "
                         "attention_mask have a known sequence dimension")
    packed = batch.get("cu_seqlens")
    if packed is not None and batch.get("attention_mask") is not None:
        raise ValueError("a packed (THD) batch masks by its documents (cu_seqlens): give it no attention_mask")
    split = {}
    for name, tensor in batch.items():
        if tensor is None or name == "cu_seqlens":  # the documents' bounds stay whole (as TE takes them)
            split[name] = tensor
            continue
        dim = _MASK_QUERY_DIM if name == "attention_mask" else _SEQUENCE_DIM[name]
        index = (positions_on_rank(tensor.size(dim), cp, rank) if packed is None
                 else document_positions_on_rank(packed, cp, rank)).to(tensor.device)
        split[name] = tensor.index_select(dim, index)
    return split
