"""What one GPU of a pipeline rank holds and sends in a step, for stock Pre-Norm or a SiameseNorm path:
``states``, ``activations`` (over ``schedule``'s microbatches in flight) and ``traffic``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from megatron_siamese.plan.activations import STOCK, Implementation, chunk_activations, tokens_of
from megatron_siamese.plan.placement import chunk_parameters, chunk_units, chunks_of
from megatron_siamese.plan.schedule import peak
from megatron_siamese.plan.shapes import PRE_NORM, Shape
from megatron_siamese.plan.states import DataParallelSharding, chunk_buffers, chunk_states, gathered_bytes
from megatron_siamese.plan.traffic import step_traffic
from megatron_siamese.runtime.layout import Layout


@dataclass(frozen=True)
class PlanInputs:
    """What the arithmetic reads: the model, its layout and batch, how it computes."""

    shape: Shape
    layout: Layout
    scheme: str  # the SiameseNorm scheme (its parameters: siamese or siamese-layer)
    impl: Implementation
    micro_batch: int
    microbatches: int  # per data-parallel rank and step
    param_bytes: int
    sharding: DataParallelSharding
    deallocate_outputs: bool = True  # a sent stage output's data freed (Megatron-LM's default); else kept to its backward
    overlapped_prefetch: bool = True  # FSDP's next all-gather beside the layer computing (CUDA's streams; not the CPU's)


# what a GPU holds, by GpuCosts field: the terms of its memory
HELD = ("weights", "grads", "optimizer", "gathered", "activations", "pipeline")


@dataclass(frozen=True)
class GpuCosts:
    """One GPU's bytes: held (states, activations at their peak, pipeline buffers) and sent per step."""

    rank: int  # pipeline rank
    weights: float
    grads: float
    optimizer: float
    activations: float
    pipeline: float
    sent: Dict[str, float] = field(default_factory=dict)
    gathered: float = 0.0  # FSDP: sharded weights and gradients unsharded for the layer computing

    @property
    def memory(self) -> float:
        return sum(getattr(self, term) for term in HELD)


def gpu_costs(inputs: PlanInputs, variant: str, rank: int) -> GpuCosts:
    """``variant``: "stock", or a SiameseNorm path ("pytorch", "apart", "joined")."""
    shape, layout = inputs.shape, inputs.layout
    scheme = PRE_NORM if variant == STOCK else inputs.scheme
    chunks = chunks_of(shape, layout, rank)
    params = [chunk_parameters(chunk, shape, scheme, layout) for chunk in chunks]
    states = [chunk_states(chunk_params, layout, inputs.param_bytes, inputs.sharding, bucketed=i == 0)
              for i, chunk_params in enumerate(params)]
    gathered = max(_gathered(chunk, shape, scheme, inputs) for chunk in chunks)
    held = [chunk_activations(chunk, shape, layout, inputs.impl, variant, inputs.micro_batch) for chunk in chunks]
    activations = peak(layout, rank, inputs.microbatches, lambda c: held[c].kept)
    activations += max(chunk.working for chunk in held)
    # freed outputs: 1F1B sends one before the next backward, the interleaved schedule after it
    freed_late = inputs.deallocate_outputs and layout.vpp is not None
    pipeline = peak(layout, rank, inputs.microbatches,
                    lambda c: held[c].received + (0 if inputs.deallocate_outputs else held[c].sent),
                    unsent_by_chunk=lambda c: held[c].sent if freed_late else 0.0)
    buffers = [dict(chunk_buffers(chunk_params, layout, inputs.param_bytes, inputs.sharding, bucketed=i == 0),
                    root_weights=_root_elements(chunk, shape, scheme, layout) * inputs.param_bytes)
               for i, (chunk, chunk_params) in enumerate(zip(chunks, params))]
    sent = step_traffic(shape, layout, chunks, params, variant, tokens_of(shape, layout, inputs.micro_batch),
                        inputs.impl.bytes, inputs.microbatches, inputs.sharding, buffers,
                        gathered_kv=inputs.impl.attention == "unfused")
    return GpuCosts(rank, sum(s.weights for s in states), sum(s.grads for s in states),
                    sum(s.optimizer for s in states), activations, pipeline, sent, gathered)


def _units(chunk, shape: Shape, scheme: str, layout: Layout) -> List[int]:
    """The elements on one GPU of each unit of a chunk (``placement.chunk_units``)."""
    return [sum(p.local_numel(layout) for p in unit) for unit in chunk_units(chunk, shape, scheme, layout)]


def _root_elements(chunk, shape: Shape, scheme: str, layout: Layout) -> int:
    """A chunk's elements outside its decoder layers (its embedding, its head) on one GPU."""
    units = _units(chunk, shape, scheme, layout)
    return sum(units[:int(chunk.first)]) + sum(units[len(units) - int(chunk.last):])


def _gathered(chunk, shape: Shape, scheme: str, inputs: PlanInputs) -> float:
    """What FSDP holds unsharded for one chunk (``states.gathered_bytes``): its layers are units,
    the rest its root (torch FSDP2 shards an untied embedding as a unit of its own)."""
    units = _units(chunk, shape, scheme, inputs.layout)
    layers = units[int(chunk.first):len(units) - int(chunk.last)]
    root, head = sum(units) - sum(layers), units[-1] if chunk.last else 0
    if inputs.sharding.fsdp == "torch" and chunk.first and not shape.tied:
        layers, root = layers + [units[0]], root - units[0]
    return gathered_bytes(inputs.sharding, layers, root, head, inputs.param_bytes, inputs.overlapped_prefetch)


def every_rank(inputs: PlanInputs, variant: str) -> List[GpuCosts]:
    return [gpu_costs(inputs, variant, rank) for rank in range(inputs.layout.pp)]


def most_loaded(costs: List[GpuCosts]) -> GpuCosts:
    """The pipeline rank that needs the most memory (the one that decides whether a job fits)."""
    return max(costs, key=lambda c: c.memory)
