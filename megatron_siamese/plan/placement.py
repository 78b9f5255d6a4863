"""What each pipeline rank holds: its model chunks (one per virtual stage), their layers, and whether
a chunk holds the embedding or the head. Megatron splits the layers evenly (``runtime/divisibility.py``):
global chunk ``k = vp_stage * pp + pp_rank`` holds layers ``[k n, (k + 1) n)``, ``n = layers / (pp * vpp)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from megatron_siamese.plan.shapes import Parameter, Shape, embedding_parameters, head_parameters, layer_parameters
from megatron_siamese.runtime.layout import Layout


@dataclass(frozen=True)
class Chunk:
    """One model chunk of a pipeline rank."""

    rank: int  # pipeline rank
    stage: int  # virtual stage on that rank
    index: int  # global chunk index, in pipeline order
    layers: Tuple[int, ...]  # global layer indices (0-based)
    first: bool  # receives no stream: holds the embedding
    last: bool  # sends no stream: holds the final norm, output layer and loss


def chunks_of(shape: Shape, layout: Layout, rank: int) -> List[Chunk]:
    """Pipeline rank ``rank``'s chunks, in virtual-stage order."""
    stages = layout.vpp or 1
    total = layout.pp * stages
    per_chunk = shape.layers // total
    found = []
    for stage in range(stages):
        index = stage * layout.pp + rank
        layers = tuple(range(index * per_chunk, (index + 1) * per_chunk))
        found.append(Chunk(rank, stage, index, layers, first=index == 0, last=index == total - 1))
    return found


def chunk_units(chunk: Chunk, shape: Shape, scheme: str, layout: Layout) -> List[List[Parameter]]:
    """The parameter tensors of one chunk (whole; ``Parameter.local_numel`` gives a rank's part) in
    the units FSDP gathers at once: the embedding, each layer, the head."""
    units = [embedding_parameters(shape, layout.pp)] if chunk.first else []
    units += [layer_parameters(shape, scheme, layer) for layer in chunk.layers]
    if chunk.last:
        units.append(head_parameters(shape, scheme, layout.pp))
    return units


def chunk_parameters(chunk: Chunk, shape: Shape, scheme: str, layout: Layout) -> List[Parameter]:
    return [param for unit in chunk_units(chunk, shape, scheme, layout) for param in unit]
