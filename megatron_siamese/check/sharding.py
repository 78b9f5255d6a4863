"""From local (sharded) Megatron parameters to global, layout-independent ones and back.

A *global name* is the name in a single-rank model (global layer index; a tied output layer named after
the embedding; experts numbered by ``local_expert_indices``). A *global tensor* undoes TP with Megatron's
own split rule (``_initialize_affine_weight_cpu``): ``tp * partition_stride`` chunks, rank r holding r,
r + tp, ...; expert weights by the expert TP rank and size (``is_expert``). Under FSDP each rank holds
one contiguous range of the flattened parameter, in DP rank order (``shard_starts``).
"""

from __future__ import annotations

import re
import zlib
from typing import Iterator, List, Optional, Tuple

import torch
from torch import Tensor

_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")


def is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a fully sharded parameter, or its gradient)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def shard_starts(sizes: List[int], group) -> List[int]:
    """Where this rank's shards of several parameters start in their flattened parameters: the sum of
    their sizes on the lower ranks of ``group`` (every rank of it calls this, for the same parameters)."""
    everyone = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, sizes, group=group)
    lower = everyone[: torch.distributed.get_rank(group)]
    return [sum(ranks[i] for ranks in lower) for i in range(len(sizes))]


def is_tensor_parallel(param: Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


# an expert's parameters: (the experts module)(local index)(the rest), per expert implementation
_SEQUENTIAL_EXPERT = re.compile(r"^(.*?\.experts)\.local_experts\.(\d+)(\..*)$")
_GROUPED_EXPERT = re.compile(r"^(.*?\.experts)(\.linear_fc[12]\.(?:weight|bias))(\d+)$")


def is_expert(name: str) -> bool:
    """Whether a (local or global) parameter name is one expert's: split over ep and etp."""
    return bool(_SEQUENTIAL_EXPERT.match(name) or _GROUPED_EXPERT.match(name))


def _global_expert_name(model_chunk, name: str) -> str:
    """``name`` with its local expert index replaced by the global one (``name`` if no expert's)."""
    sequential, grouped = _SEQUENTIAL_EXPERT.match(name), _GROUPED_EXPERT.match(name)
    if not (sequential or grouped):
        return name
    experts = (sequential or grouped).group(1)
    moe_layer = model_chunk.get_submodule(experts.rsplit(".", 1)[0])
    if sequential:
        return f"{experts}.local_experts.{moe_layer.local_expert_indices[int(sequential.group(2))]}{sequential.group(3)}"
    return f"{experts}{grouped.group(2)}{moe_layer.local_expert_indices[int(grouped.group(3))]}"


def split_of(name: str, tp_rank: int, tp: int, expert_tp_rank: Optional[int] = None,
             expert_tp: Optional[int] = None) -> Tuple[int, int]:
    """(rank, size) of the tensor-parallel split parameter ``name`` is cut by: the expert one
    for experts (unset: the same as ``tp``, Megatron's default), else ``tp``."""
    if is_expert(name) and expert_tp is not None:
        return (tp_rank if expert_tp_rank is None else expert_tp_rank), expert_tp
    return tp_rank, tp


def global_parameters(model_chunk) -> Iterator[Tuple[str, Tensor]]:
    """(global name, local parameter) for every parameter of one (unwrapped) model chunk."""
    layers = model_chunk.decoder.layers if hasattr(model_chunk, "decoder") else []
    for name, param in model_chunk.named_parameters():
        name = _global_expert_name(model_chunk, name)
        match = _LAYER.match(name)
        if match:
            layer = layers[int(match.group(2))]
            name = f"{match.group(1)}{layer.layer_number - 1}{match.group(3)}"
        elif name == "output_layer.weight" and getattr(param, "shared_embedding", False):
            name = "embedding.word_embeddings.weight"
        yield name, param


def global_shape(param: Tensor, tp: int) -> Tuple[int, ...]:
    shape = list(param.shape)
    if is_tensor_parallel(param):
        shape[param.partition_dim] *= tp
    return tuple(shape)


def shard(full: Tensor, param: Tensor, tp_rank: int, tp: int) -> Tensor:
    """The local slice of global tensor ``full`` that ``param`` holds on TP rank ``tp_rank``."""
    if not is_tensor_parallel(param) or tp == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    chunks = torch.chunk(full, tp * stride, dim=dim)
    return torch.cat(chunks[tp_rank::tp], dim=dim)


def unshard(locals_by_rank: List[Tensor], param: Tensor) -> Tensor:
    """Inverse of ``shard``: the global tensor from every TP rank's local slice."""
    if not is_tensor_parallel(param) or len(locals_by_rank) == 1:
        return locals_by_rank[0]
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    per_rank = [torch.chunk(local, stride, dim=dim) for local in locals_by_rank]
    return torch.cat([per_rank[r][s] for s in range(stride) for r in range(len(per_rank))], dim=dim)


def seeded_tensor(name: str, shape: Tuple[int, ...], seed: int) -> Tensor:
    """A deterministic fp32 tensor for ``name``, identical on every rank and layout: norm weights near
    their init, small biases, matrices scaled by fan-in so activations stay O(1)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=generator)
    if len(shape) == 1:
        return 0.1 * noise
    return noise / (shape[-1] ** 0.5)


_NORM_WEIGHT = re.compile(r"(norm\.weight|layer_norm_weight)$")


def seed_parameters(model_chunks, seed: int, tp_rank: int, tp: int, zero_centered_gamma: bool,
                    expert_tp_rank: Optional[int] = None, expert_tp: Optional[int] = None):
    """Overwrite every parameter with its slice of the global-name-seeded tensor (experts cut by the
    expert TP rank and size). Norm weights are centred on 1 (0 when stored zero-centred), the rest on 0."""
    gamma_centre = 0.0 if zero_centered_gamma else 1.0
    with torch.no_grad():
        for chunk in model_chunks:
            for name, param in global_parameters(chunk):
                rank, size = split_of(name, tp_rank, tp, expert_tp_rank, expert_tp)
                full = seeded_tensor(name, global_shape(param, size), seed)
                if _NORM_WEIGHT.search(name):
                    full += gamma_centre
                param.copy_(shard(full, param, rank, size).to(param.dtype))
