"""Context parallelism's sequence split: which tokens each rank of a CP group holds.

Megatron cuts every sequence into ``2 cp`` equal chunks and gives CP rank r chunks r and
``2 cp - 1 - r``: under a causal mask the early chunks attend to little and the late ones to
much, so each rank gets one of each and the same work (``get_batch_on_this_cp_rank``, and the
rotary embedding's ``get_pos_emb_on_this_cp_rank``, which must agree with the batch). Gathered
over the group in rank order, a tensor's sequence is then ``[c0, c(2cp-1), c1, c(2cp-2), ...]``:
``gathered_positions`` names each gathered row's place in the sequence, which is how the
context-parallel attention (``core_attention.py``) masks its keys without reordering them.

Megatron's own batch splitter changed its signature between 0.16 and 0.19 (0.19's takes the
world size when given no group); ``batch_on_rank`` is the one the package uses, for both.
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
    ``rank`` then chunk ``2 cp - 1 - rank``."""
    check_divisible(seq_length, cp)
    chunk = seq_length // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def gathered_positions(seq_length: int, cp: int) -> Tensor:
    """The sequence position of each row of a tensor all-gathered over the CP group (rank order)."""
    return torch.cat([positions_on_rank(seq_length, cp, rank) for rank in range(cp)])


def batch_on_rank(batch: Dict[str, Tensor], cp: int, rank: int) -> Dict[str, Tensor]:
    """CP rank ``rank``'s part of a microbatch: its two chunks of every per-token tensor, and of
    the attention mask its query rows (each query still sees every key). Unknown keys are
    refused: a tensor split the wrong way would train on other tokens without a word."""
    if cp == 1:
        return batch
    unknown = sorted(set(batch) - set(_SEQUENCE_DIM) - {"attention_mask"})
    if unknown:
        raise ValueError(f"cannot split {unknown} over context-parallel ranks: only {sorted(_SEQUENCE_DIM)} and "
                         "attention_mask have a known sequence dimension")
    split = {}
    for name, tensor in batch.items():
        dim = _MASK_QUERY_DIM if name == "attention_mask" else _SEQUENCE_DIM[name]
        if tensor is None:
            split[name] = None
            continue
        index = positions_on_rank(tensor.size(dim), cp, rank).to(tensor.device)
        split[name] = tensor.index_select(dim, index)
    return split
