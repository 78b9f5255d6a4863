"""The two residual streams travel between layers packed in one ``[s, b, 2h]`` tensor: X (Post-Norm-like)
in ``[..., :h]``, Y (Pre-Norm-like) in ``[..., h:]``. The block, recompute, pipeline p2p and CUDA graphs
handle one hidden-state tensor; packing along the hidden dimension leaves dimension 0 (split by SP and CP)
alone.
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
    """A new ``[..., 2h]`` tensor, never a view: Megatron's pipeline schedules free stage outputs in place."""
    return torch.cat([x, y], dim=-1)
