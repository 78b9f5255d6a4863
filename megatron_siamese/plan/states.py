"""Weights, gradients and optimizer state per GPU, and what data parallelism shards of them.

Bytes per parameter as Megatron keeps them (18 bytes a bf16 parameter under DDP); torch FSDP2's wrapper sets
no mixed-precision policy, so its gradients stay in the parameters' dtype. A 16-bit optimizer's fp32 main
gradients live only from its step to the next ``zero_grad``, when no activation is held: not counted.
Megatron DDP's buffer padding under the distributed optimizer is counted (``padded_numel``): it decides the
buffers' size on small models. FSDP gathers unit by unit (each decoder layer; the rest of a chunk is the root):
torch FSDP2 holds its root, the layer computing and the next one's all-gather (one on the CPU), one layer's
gradients and the head's; Megatron-FSDP its root, the layers it prefetches and a layer's and the root's gradients.
Full story: docs/scale.md, "Where it comes from" and "Measured against CPU ranks".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence

from megatron_siamese.plan.shapes import Parameter
from megatron_siamese.runtime.layout import FSDP_KINDS, SHARDING_STRATEGIES, Layout

FP32_GRAD_BYTES = 4  # grad_reduce_in_fp32
MEGATRON_FSDP_PREFETCH = 500_000_000  # elements: its suggested_AG_prefetch_size (max(10^9, ...) // 2)
ADAM_BYTES = 8  # exp_avg and exp_avg_sq in fp32
MAIN_PARAM_BYTES = 4


@dataclass(frozen=True)
class DataParallelSharding:
    """Which training states data parallelism shards, and how often it moves them (``gathers_per_microbatch``
    0: once a step, after the optimizer's; Megatron-FSDP's counts as measured, docs/scale.md)."""

    name: str
    weights: bool = False
    grads: bool = False
    optimizer: bool = False
    reduce_every_microbatch: bool = False
    gathers_per_microbatch: int = 0
    root_gathered_once: bool = False  # Megatron-FSDP: the root's weights gathered once a step, the layers per microbatch
    padded: bool = False  # Megatron DDP's buffers for the distributed optimizer (padded_numel)
    grads_in_param_dtype: bool = False  # reduced and kept in the parameters' dtype, not fp32 (torch FSDP2)
    fsdp: str = "none"  # the fully sharded kind (Layout.fsdp): how it gathers (gathered_bytes)

    def grad_bytes(self, param_bytes: int) -> int:
        """Bytes of one gradient element (and of what the gradient reduction sends of it)."""
        return param_bytes if self.grads_in_param_dtype else FP32_GRAD_BYTES


def data_parallel_sharding(distributed_optimizer: bool, fsdp: str = "none",
                           strategy: str = "no_shard") -> DataParallelSharding:
    """The sharding of a job: Megatron DDP (``fsdp="none"``), torch FSDP2 (``"torch"``) or Megatron-FSDP."""
    if fsdp not in FSDP_KINDS:
        raise ValueError(f"fsdp must be one of {FSDP_KINDS}, got {fsdp!r}")
    if fsdp == "none":
        if distributed_optimizer:
            return DataParallelSharding("distributed optimizer", optimizer=True, padded=True)
        return DataParallelSharding("DDP")
    if fsdp == "torch":
        return DataParallelSharding("torch FSDP2", weights=True, grads=True, optimizer=True, reduce_every_microbatch=True,
                                    gathers_per_microbatch=2, grads_in_param_dtype=True, fsdp="torch")
    if strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"data_parallel_sharding_strategy must be one of {SHARDING_STRATEGIES}, got {strategy!r}")
    level = SHARDING_STRATEGIES.index(strategy)
    return DataParallelSharding(f"Megatron-FSDP {strategy}", optimizer=level >= 1, grads=level >= 2,
                                weights=level >= 3, reduce_every_microbatch=level >= 1,
                                gathers_per_microbatch=2 if level == 3 else 0, root_gathered_once=True, fsdp="megatron")


def layout_sharding(layout: Layout) -> DataParallelSharding:
    """The sharding ``layout`` asks for."""
    return data_parallel_sharding(layout.distributed_optimizer, layout.fsdp, layout.fsdp_sharding)


def dense_dp_size(layout: Layout) -> int:
    """The ranks dense gradients are reduced and sharded over: data times context parallel."""
    return layout.dp * layout.cp


def expert_dp_size(layout: Layout) -> int:
    """The ranks an expert's gradients are reduced and sharded over (expert data parallel)."""
    return layout.tp * layout.cp * layout.dp // (layout.ep * layout.expert_tp)


def bucket_size(layout: Layout, bucketed: bool) -> float:
    """Megatron DDP's bucket size in elements (overlapped reduction only; later chunks unbucketed)."""
    if not bucketed or dense_dp_size(layout) == 1:
        return math.inf
    return max(40_000_000, 1_000_000 * dense_dp_size(layout))


def _pad(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


def padded_numel(numels: Sequence[int], shared: Sequence[bool], dp: int, size: float) -> int:
    """A distributed-optimizer buffer's elements: parameters (last to first, as DDP takes them) at multiples of
    64, buckets closed at ``size`` and ending at multiples of ``lcm(dp, 128)``, a shared embedding alone."""
    divisor = math.lcm(dp, 128)
    end = bucket_start = 0
    open_bucket = False
    for numel, alone in reversed(list(zip(numels, shared))):
        start = _pad(end, 64)
        if alone and open_bucket:
            start = bucket_start = _pad(start, divisor)
        end, open_bucket = start + numel, True
        if alone or end - bucket_start >= size:
            end = bucket_start = _pad(end, divisor)
            open_bucket = False
    return _pad(end, divisor) if open_bucket else end


@dataclass(frozen=True)
class States:
    """One GPU's weights, gradients and optimizer state, in bytes (sharded: this GPU's shards)."""

    weights: float
    grads: float
    optimizer: float


def _buffer(params: List[Parameter], layout: Layout, dp: int, padded: bool, bucketed: bool) -> int:
    numels = [p.local_numel(layout) for p in params]
    if not padded:
        return sum(numels)
    return padded_numel(numels, [p.shared_embedding for p in params], dp, bucket_size(layout, bucketed))


def _groups(params: List[Parameter], layout: Layout):
    """DDP's buffers, dense and expert, each per dtype: ``(expert, fp32, members, dp)``."""
    for expert, dp in ((False, dense_dp_size(layout)), (True, expert_dp_size(layout))):
        for fp32 in (False, True):
            members = [p for p in params if p.expert == expert and p.fp32 == fp32]
            if members:
                yield expert, fp32, members, dp


def chunk_buffers(params: Iterable[Parameter], layout: Layout, param_bytes: int, sharding: DataParallelSharding,
                  bucketed: bool) -> Dict[str, float]:
    """One chunk's whole (unsharded) gradient and weight buffers in bytes, dense and expert:
    ``grads``, ``weights``, ``expert_grads``, ``expert_weights`` (what data parallelism moves)."""
    found = dict(grads=0.0, weights=0.0, expert_grads=0.0, expert_weights=0.0)
    for expert, fp32, members, dp in _groups(list(params), layout):
        numel = _buffer(members, layout, dp, sharding.padded, bucketed)
        prefix = "expert_" if expert else ""
        found[prefix + "grads"] += numel * sharding.grad_bytes(param_bytes)
        found[prefix + "weights"] += numel * (4 if fp32 else param_bytes)
    return found


def chunk_states(params: Iterable[Parameter], layout: Layout, param_bytes: int, sharding: DataParallelSharding,
                 bucketed: bool) -> States:
    """The states of one model chunk's parameters on one GPU (``bucketed``: the chunk's DDP buckets
    its gradients, Megatron's first chunk); what FSDP gathers is ``gathered_bytes``'s."""
    params = list(params)
    buffers = chunk_buffers(params, layout, param_bytes, sharding, bucketed)
    dense, experts = dense_dp_size(layout), expert_dp_size(layout)
    weights = buffers["weights"] / (dense if sharding.weights else 1)
    weights += buffers["expert_weights"] / (experts if sharding.weights else 1)
    grads = buffers["grads"] / (dense if sharding.grads else 1)
    grads += buffers["expert_grads"] / (experts if sharding.grads else 1)
    optimizer = 0.0
    for _, fp32, members, dp in _groups(params, layout):
        main_copy = sharding.fsdp == "megatron" or (not fp32 and param_bytes < 4)
        per_param = ADAM_BYTES + (MAIN_PARAM_BYTES if main_copy else 0)
        optimizer += sum(p.local_numel(layout) for p in members) * per_param / (dp if sharding.optimizer else 1)
    return States(weights, grads, optimizer)


def gathered_bytes(sharding: DataParallelSharding, layers: Sequence[int], root: int, head: int, param_bytes: int,
                   overlapped_prefetch: bool = True) -> float:
    """What FSDP holds unsharded at most at once on one GPU (the module docstring), from the elements of each
    layer and of the ``root`` (``head`` of them the head's); ``overlapped_prefetch``: CUDA's, not the CPU's."""
    if not (sharding.weights or sharding.grads):
        return 0.0
    largest, grad_bytes = max(layers, default=0), sharding.grad_bytes(param_bytes)
    if sharding.fsdp == "torch":  # the head's gradients, the first computed, wait for the root's reduce-scatter
        return (root + largest * (2 if overlapped_prefetch else 1)) * param_bytes + (largest + head) * grad_bytes
    if not sharding.weights:  # optim_grads: the chunk is one unit, its gradients whole until reduced
        return (sum(layers) + root) * grad_bytes
    weights = root + min(sum(layers), largest + MEGATRON_FSDP_PREFETCH)
    return weights * param_bytes + (largest + root) * grad_bytes
