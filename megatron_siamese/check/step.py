"""One training step of a tiny GPT under a parallel layout, reported layout-independently.

``run_rank(case, layout)`` runs on every rank: this rank's ``MegatronGPT`` with global-name-seeded
weights, one step over its share of the global batch, and what it holds locally (losses, gradients or
the range it owns, updated parameters). ``assemble(results)`` puts the pieces back together as global
tensors, so any two layouts compare tensor by tensor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

import torch
from torch import Tensor

from megatron_siamese import device

from megatron_siamese.check.sharding import (
    global_parameters,
    is_dtensor,
    is_expert,
    seed_parameters,
    shard_starts,
    unshard,
)
from megatron_siamese.check.case import ModelCase
from megatron_siamese.runtime.gpt import MegatronGPT, transformer_config, unwrap
from megatron_siamese.runtime.layout import Layout

T = TypeVar("T")


@dataclass
class Piece:
    """A rank's local view of one global tensor."""

    values: Tensor  # flattened; for a ranged piece only [start, start + len)
    start: int
    local_shape: Tuple[int, ...]
    tp_rank: int  # in the split the tensor is cut by: the expert TP group's for experts
    tensor_parallel: bool
    partition_dim: int
    partition_stride: int


@dataclass
class RankResult:
    rank: int
    tp_rank: int
    losses: Dict[int, float] = field(default_factory=dict)  # global microbatch -> loss
    grads: Dict[str, Piece] = field(default_factory=dict)
    params: Dict[str, Piece] = field(default_factory=dict)
    grad_norm: Optional[float] = None
    memory_mb: float = 0.0


def memory_mb() -> float:
    """This rank's memory now: peak allocated on its GPU (since the last reset), else its resident set."""
    if device.uses_cuda():
        return torch.cuda.max_memory_allocated() / 2**20
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# -- setup -------------------------------------------------------------------------------


def microbatches(case: ModelCase) -> List[Dict[str, Tensor]]:
    """The global batch: ``num_microbatches`` microbatches of random tokens."""
    generator = torch.Generator().manual_seed(case.seed)
    shape = (case.num_microbatches, case.micro_batch_size, case.seq_length + 1)
    tokens = torch.randint(0, case.vocab_size, shape, generator=generator)
    positions = torch.arange(case.seq_length).expand(case.micro_batch_size, -1)
    causal = torch.ones(case.seq_length, case.seq_length, dtype=torch.bool).triu(1)
    if case.packed_sequences:
        return [packed(t, case) for t in tokens]
    return [
        dict(
            tokens=t[:, :-1].contiguous(),
            labels=t[:, 1:].contiguous(),
            position_ids=positions.contiguous(),
            attention_mask=causal[None, None],
            loss_mask=torch.ones(case.micro_batch_size, case.seq_length),
        )
        for t in tokens
    ]


def packed(tokens: Tensor, case: ModelCase) -> Dict[str, Tensor]:
    """A microbatch's samples ``[b, s + 1]`` as one packed (THD) row of ``b s`` tokens: their
    documents' bounds (``cu_seqlens``) and each document's own positions, no attention mask."""
    lengths = case.document_lengths * case.micro_batch_size
    bounds = torch.tensor([0] + lengths).cumsum(0)
    return dict(
        tokens=tokens[:, :-1].reshape(1, -1),
        labels=tokens[:, 1:].reshape(1, -1),
        position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
        loss_mask=torch.ones(1, int(bounds[-1])),
        cu_seqlens=bounds.to(torch.int32),
    )


def config_overrides(case: ModelCase) -> dict:
    """The case's TransformerConfig settings beyond its ModelSettings."""
    found = dict(hidden_dropout=case.hidden_dropout, attention_dropout=case.attention_dropout,
                 bias_activation_fusion=case.bias_activation_fusion)
    return found if case.batch_p2p_comm is None else dict(found, batch_p2p_comm=case.batch_p2p_comm)


def case_config(case: ModelCase, layout: Layout):
    """The case's SiameseTransformerConfig under ``layout``."""
    return transformer_config(case, layout, **config_overrides(case))


def build_seeded_chunks(case: ModelCase, config, tp_rank: int = 0, tp: int = 1):
    """The case's model chunks for this rank (unwrapped), weights seeded from their global names."""
    from megatron_siamese.models import build_model_chunks

    chunks = build_model_chunks(config, case, case.vocab_size)
    seed_parameters(chunks, case.seed, tp_rank, tp, case.zero_centered_gamma)
    return chunks


def seeded_gpt(case: ModelCase, layout: Layout) -> MegatronGPT:
    """This rank's MegatronGPT for the case, weights seeded from their global names."""
    from megatron.core import parallel_state

    def seed(chunks):
        seed_parameters(chunks, case.seed, parallel_state.get_tensor_model_parallel_rank(), layout.tp,
                        case.zero_centered_gamma, parallel_state.get_expert_tensor_parallel_rank(), layout.expert_tp)

    optimizer = dict(lr=case.lr, adam_eps=case.adam_eps, weight_decay=0.0, clip_grad=case.clip_grad)
    return MegatronGPT(case, layout, case.vocab_size, optimizer, case.seed, init_weights=seed,
                       siamese_p2p=case.siamese_p2p, **config_overrides(case))


def _pieces(chunks, tensor_of, optimizer, tp_rank: int, expert_tp_rank: int, fsdp: str = "none") -> Dict[str, Piece]:
    pieces, shards = {}, []
    for chunk in chunks:
        held_by = fsdp_shards(chunk) if fsdp == "megatron" else {}
        for name, param in global_parameters(unwrap(chunk)):
            held = held_by.get(id(param), param)  # the tensor that holds this rank's part of it
            tensor = tensor_of(held)
            if is_dtensor(held):  # a fully sharded parameter: this rank's contiguous part of it
                tensor = held.to_local().new_empty(0) if tensor is None else tensor.to_local()
            tensor = tensor.detach().float().reshape(-1).cpu()  # gathered to rank 0 as bytes
            start, end = 0, tensor.numel()
            if optimizer is not None:
                start, end = _owned_range(optimizer, param)
            pieces[name] = Piece(
                values=tensor[start:end].clone(),
                start=start,
                local_shape=tuple(getattr(held, "orig_param", held).shape),
                tp_rank=expert_tp_rank if is_expert(name) else tp_rank,
                tensor_parallel=bool(getattr(held, "tensor_model_parallel", False)),
                partition_dim=getattr(held, "partition_dim", -1),
                partition_stride=getattr(held, "partition_stride", 1),
            )
            if is_dtensor(held):
                shards.append((pieces[name], held.device_mesh.get_group(0)))
    for group in dict.fromkeys(group for _, group in shards):  # the DP group, or experts' own (in one order)
        held_here = [piece for piece, its_group in shards if its_group is group]
        for piece, start in zip(held_here, shard_starts([piece.values.numel() for piece in held_here], group)):
            piece.start = start
    return pieces


def fsdp_shards(chunk) -> Dict[int, Tensor]:
    """Megatron-FSDP: the DTensor its optimizer steps for each module parameter (``orig_param``, with its
    gradient), by the module parameter's id (between steps the module holds other DTensors)."""
    # named as in the module Megatron-FSDP wraps: Float16Module (bf16) adds "module."
    by_name = {name.removeprefix("module."): shard
               for name, shard in chunk.param_and_grad_buffer.optimizer_named_parameters}
    return {id(param): by_name[name] for name, param in unwrap(chunk).named_parameters()}


def _main_grad(param):
    """The reduced gradient a rank holds: a DDP buffer's ``main_grad``; fully sharded, its shard's
    ``grad`` (or the plain ``grad`` of a parameter FSDP does not manage)."""
    return param.main_grad if hasattr(param, "main_grad") and not is_dtensor(param) else param.grad


def _owned_range(optimizer, param) -> Tuple[int, int]:
    """The flattened range of ``param`` whose reduced gradient this DP rank owns."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if param in getattr(opt, "model_param_gbuf_map", {}):
            owned = opt._get_model_param_range_map(param)["param"]
            return owned.start, owned.end
    return 0, 0  # a parameter no range of which lives on this rank


# -- the per-rank job --------------------------------------------------------------------


def with_case_fault(case: ModelCase, layout: Layout, body: Callable[[ModelCase, Layout], T]) -> T:
    """``body(case, layout)`` with the case's fault planted and undone after, and Megatron's process
    groups torn down after it, after an error too (the next layout must not inherit them)."""
    from megatron.core import parallel_state

    from megatron_siamese.check.faults import planted

    try:
        with planted(case.fault):
            return body(case, layout)
    finally:
        parallel_state.destroy_model_parallel()


def run_rank(case: ModelCase, layout: Layout) -> RankResult:
    """Everything one rank does; see the module docstring."""
    if device.uses_cuda():
        torch.cuda.reset_peak_memory_stats()
    return with_case_fault(case, layout, _step)


def _step(case: ModelCase, layout: Layout) -> RankResult:
    from megatron.core import parallel_state

    gpt = seeded_gpt(case, layout)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    expert_tp_rank = parallel_state.get_expert_tensor_parallel_rank()
    dp_rank, dp = parallel_state.get_data_parallel_rank(), layout.dp
    if case.num_microbatches % dp:
        raise ValueError(f"num_microbatches={case.num_microbatches} is not divisible by dp={dp}")
    per_rank = case.num_microbatches // dp
    gpt.zero_grad()
    losses = gpt.forward_backward(microbatches(case)[dp_rank * per_rank : (dp_rank + 1) * per_rank])
    result = RankResult(rank=torch.distributed.get_rank(), tp_rank=tp_rank)
    if parallel_state.is_pipeline_last_stage():
        result.losses = {dp_rank * per_rank + i: float(d["loss"]) for i, d in enumerate(losses)}
    owner = gpt.optimizer if layout.distributed_optimizer and layout.fsdp == "none" else None
    result.grads = _pieces(gpt.model, _main_grad, owner, tp_rank, expert_tp_rank, layout.fsdp)
    _, grad_norm, _ = gpt.optimizer.step()
    result.grad_norm = None if grad_norm is None else float(grad_norm)
    result.params = _pieces(gpt.model, lambda p: p, None, tp_rank, expert_tp_rank, layout.fsdp)
    result.memory_mb = memory_mb()
    return result


# -- putting ranks back together ---------------------------------------------------------


@dataclass
class StepResult:
    """A layout's step as global tensors."""

    losses: Dict[int, float]
    grads: Dict[str, Tensor]
    params: Dict[str, Tensor]
    grad_norm: Optional[float]
    # max |difference| between copies of the same replicated tensor on different ranks
    replica_spread: Dict[str, float]
    memory_mb: float = 0.0  # the largest rank's


def _assemble(pieces_by_rank: List[Dict[str, Piece]]) -> Tuple[Dict[str, Tensor], Dict[str, float]]:
    by_name: Dict[str, List[Piece]] = {}
    for pieces in pieces_by_rank:
        for name, piece in pieces.items():
            by_name.setdefault(name, []).append(piece)
    tensors, spread = {}, {}
    for name, pieces in by_name.items():
        locals_by_tp: Dict[int, List[Tensor]] = {}
        for tp_rank in sorted({p.tp_rank for p in pieces}):
            copies = _fill_copies([p for p in pieces if p.tp_rank == tp_rank])
            locals_by_tp[tp_rank] = copies
        first = pieces[0]
        if first.tensor_parallel:
            copies = [
                unshard([locals_by_tp[r][i] for r in sorted(locals_by_tp)], _Meta(first))
                for i in range(min(len(c) for c in locals_by_tp.values()))
            ]
        else:
            copies = [c for tp in sorted(locals_by_tp) for c in locals_by_tp[tp]]
        tensors[name] = copies[0]
        spread[name] = max((float((c - copies[0]).abs().max()) for c in copies[1:]), default=0.0)
    return tensors, spread


class _Meta:
    """Stands in for a parameter in ``unshard`` (only its partition attributes are read)."""

    def __init__(self, piece: Piece):
        self.tensor_model_parallel = piece.tensor_parallel
        self.partition_dim = piece.partition_dim
        self.partition_stride = piece.partition_stride


def _fill_copies(pieces: List[Piece]) -> List[Tensor]:
    """Full local tensors from pieces of one TP rank: whole pieces are copies (DP replicas, tied
    embeddings); ranged pieces (distributed optimizer) are stitched and must cover the tensor."""
    numel = 1
    for size in pieces[0].local_shape:
        numel *= size
    whole = [p for p in pieces if p.values.numel() == numel and p.start == 0]
    if whole:
        return [p.values.view(p.local_shape) for p in whole]
    flat = torch.full((numel,), float("nan"))
    for p in pieces:
        flat[p.start : p.start + p.values.numel()] = p.values
    if torch.isnan(flat).any():
        raise AssertionError("distributed-optimizer shards do not cover the whole gradient")
    return [flat.view(pieces[0].local_shape)]


def assemble(results: List[RankResult]) -> StepResult:
    losses: Dict[int, float] = {}
    for result in results:
        if result.tp_rank == 0:
            losses.update(result.losses)
    grads, grad_spread = _assemble([r.grads for r in results])
    params, param_spread = _assemble([r.params for r in results])
    spread = {f"grad:{k}": v for k, v in grad_spread.items()}
    spread.update({f"param:{k}": v for k, v in param_spread.items()})
    norms = [r.grad_norm for r in results if r.grad_norm is not None]
    return StepResult(losses, grads, params, norms[0] if norms else None, spread,
                      max(r.memory_mb for r in results))


def layout_step(case: ModelCase, layout: Layout) -> Optional[StepResult]:
    """One step on every rank of a job of ``layout.world_size`` ranks; rank 0 gathers the ranks'
    pieces (torch.distributed) and returns them as global tensors, the others None."""
    from megatron_siamese.runtime.job import gather_to_rank0

    pieces = gather_to_rank0(run_rank(case, layout))
    return None if pieces is None else assemble(pieces)


