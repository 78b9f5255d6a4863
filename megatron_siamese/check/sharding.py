"""From local (sharded) Megatron parameters to global, layout-independent ones and back.

A parameter's *global name* is its name in a single-rank model: the local layer index
of a pipeline stage is replaced by the global one (``layer_number - 1``), and the output
layer that shares the word embeddings on the last stage is named after the embedding.
Its *global tensor* undoes tensor parallelism with Megatron's own split rule (the one
``_initialize_affine_weight_cpu`` uses): along ``partition_dim`` the global tensor is cut
into ``tp * partition_stride`` equal chunks and rank r holds chunks r, r + tp, ...
(stride 2 is how gated MLPs keep [gate, up] halves per rank).
"""

from __future__ import annotations

import re
import zlib
from typing import Iterator, List, Tuple

import torch
from torch import Tensor

_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")


def is_tensor_parallel(param: Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def global_parameters(model_chunk) -> Iterator[Tuple[str, Tensor]]:
    """(global name, local parameter) for every parameter of one (unwrapped) model chunk."""
    layers = model_chunk.decoder.layers if hasattr(model_chunk, "decoder") else []
    for name, param in model_chunk.named_parameters():
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
    """A deterministic fp32 tensor for ``name``: identical on every rank and layout.

    Norm weights stay near their init (so zero-centred gamma and degenerate weights are
    meaningful), biases are small, matrices are scaled by fan-in so activations stay O(1).
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=generator)
    if len(shape) == 1:
        return 0.1 * noise
    return noise / (shape[-1] ** 0.5)


_NORM_WEIGHT = re.compile(r"(norm\.weight|layer_norm_weight)$")


def seed_parameters(model_chunks, seed: int, tp_rank: int, tp: int, zero_centered_gamma: bool):
    """Overwrite every parameter with the slice of its global-name-seeded tensor.

    Norm weights are centred on 1 (on 0 when stored zero-centred), everything else on 0.
    """
    gamma_centre = 0.0 if zero_centered_gamma else 1.0
    with torch.no_grad():
        for chunk in model_chunks:
            for name, param in global_parameters(chunk):
                full = seeded_tensor(name, global_shape(param, tp), seed)
                if _NORM_WEIGHT.search(name):
                    full += gamma_centre
                param.copy_(shard(full, param, tp_rank, tp).to(param.dtype))
