"""The two residual streams travel between layers packed in one tensor.

``[s, b, 2h]`` with the X stream (Post-Norm-like) in ``[..., :h]`` and the Y stream
(Pre-Norm-like) in ``[..., h:]``. TransformerBlock, activation recompute, pipeline p2p and
CUDA graphs all handle one hidden-state tensor; packing along the hidden dimension keeps
dimension 0 (the one sequence and context parallelism split) untouched.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor


def split_streams(packed: Tensor, hidden_size: int) -> Tuple[Tensor, Tensor]:
    """Views of the X and Y streams of a packed ``[..., 2h]`` tensor."""
    if packed.shape[-1] != 2 * hidden_size:
        raise ValueError(
            f"expected packed SiameseNorm streams with last dimension 2*hidden_size="
            f"{2 * hidden_size}, got shape {tuple(packed.shape)}"
        )
    return packed[..., :hidden_size], packed[..., hidden_size:]


def pack_streams(x: Tensor, y: Tensor) -> Tensor:
    """A new (never a view) ``[..., 2h]`` tensor holding X then Y.

    Megatron's pipeline schedules free stage outputs in place and insist they own their
    storage, so the packed output must not alias anything.
    """
    return torch.cat([x, y], dim=-1)
