"""One training step of a tiny GPT under a parallel layout, reported layout-independently.

``run_rank(case, layout)`` runs on every rank of a launched job: it sets up Megatron's
process groups, builds this rank's model chunks, overwrites every parameter with its
global-name-seeded value, wraps the chunks in Megatron's DistributedDataParallel, runs
``get_forward_backward_func`` over the case's global batch (each DP rank its share of the
microbatches), lets the schedule's ``finalize_model_grads`` reduce gradients, takes one
optimizer step, and returns what it holds locally: per-microbatch losses, gradients
(the range it owns under the distributed optimizer) and updated parameters.
``assemble(results)`` then puts the ranks' pieces back together into global tensors
keyed by global parameter name, so any two layouts can be compared tensor by tensor.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from megatron_siamese.testing.layouts import Layout
from megatron_siamese.testing.sharding import global_parameters, seed_parameters, unshard

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ModelCase:
    """A tiny GPT and its data: everything but the parallel layout."""

    norm: str = "siamese"  # a scheme of megatron_siamese.gpt.NORM_SCHEMES
    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 64
    vocab_size: int = 128
    seq_length: int = 16
    micro_batch_size: int = 2
    num_microbatches: int = 4  # global: split over DP ranks
    normalization: str = "LayerNorm"
    gated_linear_unit: bool = True
    position_embedding_type: str = "rope"
    share_embeddings_and_output_weights: bool = True
    add_bias_linear: bool = True
    zero_centered_gamma: bool = False
    dtype: str = "fp32"
    seed: int = 1234
    # Adam (the distributed optimizer supports nothing else). Its first step is
    # lr * g / (|g| + eps); a large eps keeps that sensitive to the gradient's scale.
    lr: float = 0.1
    adam_eps: float = 1.0
    clip_grad: float = 1.0
    # None: Megatron's default (batched) on GPUs, off on gloo, where interleaved + batched
    # p2p gives wrong results even for the stock layer (docs/parallelism.md)
    batch_p2p_comm: Optional[bool] = None
    # PP>1: hand the schedule SiameseP2PCommunicator (the Python API way); False leaves
    # Megatron's default communicator with shape exchange (the Megatron-LM way).
    siamese_p2p: bool = True
    fault: Optional[str] = None  # a bug from testing.faults planted on every rank
    fused: Optional[bool] = None  # SiameseTransformerConfig.siamese_fused_ops
    variant: str = "standard"  # SiameseTransformerConfig.siamese_variant
    transformer_impl: str = "local"  # "transformer_engine" for the TE spec (GPUs)


@dataclass
class Piece:
    """A rank's local view of one global tensor."""

    values: Tensor  # flattened; for a ranged piece only [start, start + len)
    start: int
    local_shape: Tuple[int, ...]
    tp_rank: int
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


# -- setup -------------------------------------------------------------------------------


def transformer_config(case: ModelCase, layout: Layout):
    import torch.nn.functional as F

    from megatron_siamese.config import SiameseTransformerConfig, recompute_options

    dtype = DTYPES[case.dtype]
    recompute = recompute_options(layout.recompute)
    return SiameseTransformerConfig(
        siamese_fused_ops=case.fused,
        siamese_variant=case.variant,
        num_layers=case.num_layers,
        hidden_size=case.hidden_size,
        num_attention_heads=case.num_attention_heads,
        num_query_groups=case.num_query_groups,
        ffn_hidden_size=case.ffn_hidden_size,
        normalization=case.normalization,
        layernorm_zero_centered_gamma=case.zero_centered_gamma,
        gated_linear_unit=case.gated_linear_unit,
        activation_func=F.silu if case.gated_linear_unit else F.gelu,
        add_bias_linear=case.add_bias_linear,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.sp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        batch_p2p_comm=(
            torch.cuda.is_available() if case.batch_p2p_comm is None else case.batch_p2p_comm
        ),
        use_cpu_initialization=True,
        transformer_impl=case.transformer_impl,
        **recompute,
    )


def build_seeded_chunks(case: ModelCase, config, tp_rank: int = 0, tp: int = 1):
    """The case's GPT chunks for this rank, weights seeded from their global names."""
    from megatron_siamese.gpt import build_gpt_chunks

    chunks = build_gpt_chunks(
        config,
        case.norm,
        case.vocab_size,
        case.seq_length,
        case.position_embedding_type,
        case.share_embeddings_and_output_weights,
    )
    seed_parameters(chunks, case.seed, tp_rank, tp, case.zero_centered_gamma)
    return chunks


def initialize_model_parallel(layout: Layout, seed: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
    )
    model_parallel_cuda_manual_seed(seed)


def microbatches(case: ModelCase) -> List[Dict[str, Tensor]]:
    """The global batch: ``num_microbatches`` microbatches of random tokens."""
    generator = torch.Generator().manual_seed(case.seed)
    shape = (case.num_microbatches, case.micro_batch_size, case.seq_length + 1)
    tokens = torch.randint(0, case.vocab_size, shape, generator=generator)
    positions = torch.arange(case.seq_length).expand(case.micro_batch_size, -1)
    causal = torch.ones(case.seq_length, case.seq_length, dtype=torch.bool).triu(1)
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


def _loss_func(loss_mask: Tensor, output: Tensor):
    loss = (output.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"loss": loss.detach().clone()}  # the schedule rescales `loss` in place


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    batch = {k: v.to(torch.cuda.current_device()) for k, v in batch.items()}
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return output, partial(_loss_func, batch["loss_mask"])


def unwrap(chunk):
    """The GPTModel inside DistributedDataParallel / Float16Module wrappers."""
    while not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def _pieces(chunks, tensor_of, optimizer, tp_rank) -> Dict[str, Piece]:
    pieces = {}
    for chunk in chunks:
        for name, param in global_parameters(unwrap(chunk)):
            tensor = tensor_of(param).detach().float().reshape(-1)
            start, end = 0, tensor.numel()
            if optimizer is not None:
                start, end = _owned_range(optimizer, param)
            pieces[name] = Piece(
                values=tensor[start:end].clone(),
                start=start,
                local_shape=tuple(param.shape),
                tp_rank=tp_rank,
                tensor_parallel=bool(getattr(param, "tensor_model_parallel", False)),
                partition_dim=getattr(param, "partition_dim", -1),
                partition_stride=getattr(param, "partition_stride", 1),
            )
    return pieces


def _owned_range(optimizer, param) -> Tuple[int, int]:
    """The flattened range of ``param`` whose reduced gradient this DP rank owns."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if param in getattr(opt, "model_param_gbuf_map", {}):
            owned = opt._get_model_param_range_map(param)["param"]
            return owned.start, owned.end
    return 0, 0  # a parameter no range of which lives on this rank


# -- the per-rank job --------------------------------------------------------------------


def run_rank(case: ModelCase, layout: Layout) -> RankResult:
    """Everything one rank does; see the module docstring."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import Float16Module

    from megatron_siamese.pipeline import SiameseP2PCommunicator

    if case.fault:
        from megatron_siamese.testing.faults import plant

        plant(case.fault)
    initialize_model_parallel(layout, case.seed)
    config = transformer_config(case, layout)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    chunks = build_seeded_chunks(case, config, tp_rank, layout.tp)
    if config.bf16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=layout.dp > 1,
        use_distributed_optimizer=layout.distributed_optimizer,
    )
    chunks = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=(i > 0))
        for i, chunk in enumerate(chunks)
    ]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=case.lr,
            adam_eps=case.adam_eps,
            weight_decay=0.0,
            clip_grad=case.clip_grad,
            bf16=config.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=layout.distributed_optimizer,
        ),
        chunks,
    )
    config.finalize_model_grads_func = finalize_model_grads
    if ddp_config.overlap_grad_reduce:  # as Megatron-LM's training loop wires it
        no_sync = [chunk.no_sync for chunk in chunks]
        grad_sync = [chunk.start_grad_sync for chunk in chunks]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync

    dp_rank, dp = parallel_state.get_data_parallel_rank(), layout.dp
    if case.num_microbatches % dp:
        raise ValueError(f"num_microbatches={case.num_microbatches} is not divisible by dp={dp}")
    per_rank = case.num_microbatches // dp
    mine = microbatches(case)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    iterators = [iter(mine) for _ in chunks]

    pipeline_kwargs = {}
    if layout.pp > 1 and case.siamese_p2p and case.norm.startswith("siamese"):
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        pipeline_kwargs = dict(
            p2p_communicator=SiameseP2PCommunicator(pg_collection.pp, config),
            pg_collection=pg_collection,
        )
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=per_rank,
        seq_length=case.seq_length,
        micro_batch_size=case.micro_batch_size,
        forward_only=False,
        **pipeline_kwargs,
    )
    result = RankResult(rank=torch.distributed.get_rank(), tp_rank=tp_rank)
    if parallel_state.is_pipeline_last_stage():
        result.losses = {dp_rank * per_rank + i: float(d["loss"]) for i, d in enumerate(losses)}
    owner = optimizer if layout.distributed_optimizer else None
    result.grads = _pieces(chunks, lambda p: p.main_grad, owner, tp_rank)
    _, grad_norm, _ = optimizer.step()
    result.grad_norm = None if grad_norm is None else float(grad_norm)
    result.params = _pieces(chunks, lambda p: p, None, tp_rank)
    parallel_state.destroy_model_parallel()
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
    """Full local tensors from pieces of one TP rank.

    Whole pieces are separate copies (DP replicas, or the two holders of tied embeddings);
    ranged pieces (distributed optimizer) are stitched into one tensor and must cover it.
    """
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
    return StepResult(losses, grads, params, norms[0] if norms else None, spread)


def run_layout(case: ModelCase, layout: Layout, backend: Optional[str] = None) -> StepResult:
    """Launch ``layout.world_size`` ranks, run one step, return it as global tensors."""
    from megatron_siamese.testing.launch import launch

    return assemble(launch(run_rank, layout.world_size, case, layout, backend=backend))


def case_dict(case: ModelCase) -> dict:
    return asdict(case)
