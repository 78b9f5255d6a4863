"""One rank's Megatron GPT: the runtime of the parallel check, the plan's measurements and the benches.

ModelSettings + Layout -> SiameseTransformerConfig -> GPTModel or HybridModel chunks -> GPU, Float16Module,
DDP or a fully sharded wrapper (runtime/data_parallel.py) -> Megatron's optimizer and finalize_model_grads
-> get_forward_backward_func, with SiameseP2PCommunicator when stages send packed streams. Everything
is Megatron's own machinery, put together once here.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from megatron_siamese import device
from megatron_siamese.runtime.layout import Layout
from megatron_siamese.runtime.registry import config_kwargs
from megatron_siamese.runtime.settings import DTYPE_NAMES, ModelSettings

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
assert tuple(DTYPES) == DTYPE_NAMES, "runtime/settings.py offers the dtypes this module builds"


def transformer_config(model: ModelSettings, layout: Layout, **overrides):
    """The SiameseTransformerConfig of ``model`` under ``layout`` (``overrides`` win); settings
    TransformerConfig takes as they are come from their definitions (runtime/settings.py, layout.py)."""
    import torch.nn.functional as F

    from megatron_siamese.config import siamese_config_class
    from megatron_siamese.hybrid_pattern import num_layers
    from megatron_siamese.models import scheme
    from megatron_siamese.runtime.settings import MLA_SETTINGS, moe_layer_freq

    dtype = DTYPES[model.dtype]
    on_gpu = device.uses_cuda()
    fields = dict(
        **{**config_kwargs(model, ModelSettings), **scheme(model.norm).config},  # what a scheme needs wins
        **config_kwargs(layout, Layout),
        num_layers=num_layers(model),  # a HybridModel's: one per pattern symbol
        ffn_hidden_size=model.mlp_width,
        # only with experts: a pattern makes Megatron save the layers unstacked (non-homogeneous)
        moe_layer_freq=moe_layer_freq(model.moe_layer_freq) if model.num_moe_experts else 1,
        # Megatron's own default, said here so that it does not warn about taking it
        moe_ffn_hidden_size=model.expert_width if model.num_moe_experts else None,
        activation_func=F.silu if model.gated_linear_unit else F.gelu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        # gloo + interleaved schedule + batched p2p gives wrong results (docs/parallelism.md)
        batch_p2p_comm=on_gpu,
        # a stage output's data freed once sent, as Megatron-LM's arguments.py always sets it
        deallocate_pipeline_outputs=True,
        **layout.recompute_options(),
    )
    if model.multi_latent_attention:  # MLATransformerConfig's own fields (one unset: Megatron's default, as
        # its rope_type yarn), but q_lora_rank unset means queries projected directly (Megatron's default: 512)
        fields.update({name: getattr(model, name) for name in MLA_SETTINGS
                       if getattr(model, name) is not None or name == "q_lora_rank"})
    fields.update(overrides)
    return siamese_config_class(fields.get("multi_latent_attention", False))(**fields)


def initialize_model_parallel(layout: Layout, seed: int) -> None:
    """Megatron's process groups for ``layout`` and its seeded RNGs (tensor-parallel tracker too)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_siamese.runtime.job import group_timeout_minutes

    parallel_state.initialize_model_parallel(
        **layout.model_parallel_sizes(),
        # the job's --distributed-timeout-minutes, not Megatron's 30: a rank that dies or hangs
        # while the others form or use these groups ends the job in that time (launch.py)
        distributed_timeout_minutes=group_timeout_minutes(),
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def packs_streams(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether these model chunks carry SiameseNorm's packed ``[s, b, 2h]`` streams."""
    from megatron_siamese.layer import SiameseTransformerLayer

    return any(isinstance(m, SiameseTransformerLayer) for chunk in chunks for m in chunk.modules())


def pipeline_communication(chunks: Sequence[torch.nn.Module], config) -> dict:
    """Schedule keywords: ``SiameseP2PCommunicator`` when stages send packed streams, else none."""
    if config.pipeline_model_parallel_size == 1 or not packs_streams(chunks):
        return {}
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_siamese.pipeline import SiameseP2PCommunicator

    groups = ProcessGroupCollection.use_mpu_process_groups()
    return dict(p2p_communicator=SiameseP2PCommunicator(groups.pp, config), pg_collection=groups)


def loss_func(loss_mask: Tensor, output: Tensor):
    """The microbatch's mean token loss. Under CP a rank's loss is its tokens' sum over the whole
    sequence's count, so the gradient is the whole sequence's mean loss's however the mask falls."""
    from megatron.core import parallel_state

    total, count = (output.float() * loss_mask).sum(), loss_mask.sum().float()
    if parallel_state.get_context_parallel_world_size() > 1:
        whole = torch.stack([total.detach(), count])
        torch.distributed.all_reduce(whole, group=parallel_state.get_context_parallel_group())
        loss = total / whole[1]
        return loss, {"loss": whole[0] / whole[1]}
    loss = total / count
    return loss, {"loss": loss.detach().clone()}  # the schedule rescales `loss` in place


def forward_step(data_iterator, model):
    """Megatron's forward-step contract, on a microbatch (this rank's CP chunks taken here) or a
    packed row of documents (``cu_seqlens``, no mask: the attention masks by document)."""
    from megatron.core import parallel_state

    from megatron_siamese.context_parallel import batch_on_rank

    batch = {k: v.to(device.current()) for k, v in next(data_iterator).items()}
    batch = batch_on_rank(batch, parallel_state.get_context_parallel_world_size(),
                          parallel_state.get_context_parallel_rank())
    documents = batch.get("cu_seqlens")  # a packed (THD) microbatch: one row of whole documents
    # the loss mask also scores multi-token prediction's depths (rolled with the labels), as in pretrain_gpt.py
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
                   loss_mask=batch["loss_mask"],
                   packed_seq_params=None if documents is None else packed_sequence_params(documents))
    return output, partial(loss_func, batch["loss_mask"])


def packed_sequence_params(cu_seqlens: Tensor):
    """Megatron's ``PackedSeqParams`` (THD) for one packed row of documents bounded by ``cu_seqlens``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = cu_seqlens.to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def unwrap(chunk):
    """The GPTModel inside DistributedDataParallel / Float16Module wrappers."""
    while not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


class MegatronGPT:
    """This rank's GPT chunks wrapped for training, their optimizer, and the schedule.

    ``optimizer``: OptimizerConfig fields; ``init_weights`` may overwrite the built chunks before wrapping;
    ``siamese_p2p=False`` keeps Megatron's own communicator (as ``pretrain_gpt.py`` runs)."""

    def __init__(
        self,
        model: ModelSettings,
        layout: Layout,
        vocab_size: int,
        optimizer: Dict[str, object],
        seed: int,
        init_weights: Optional[Callable[[List[torch.nn.Module]], None]] = None,
        siamese_p2p: bool = True,
        **config_overrides,
    ):
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        from megatron_siamese.models import build_model_chunks
        from megatron_siamese.runtime import data_parallel

        self.settings, self.layout = model, layout
        initialize_model_parallel(layout, seed)
        self.config = config = transformer_config(model, layout, **config_overrides)
        chunks = build_model_chunks(config, model, vocab_size)
        if init_weights is not None:
            init_weights(chunks)
        if device.uses_cuda():
            chunks = [chunk.to(device.current()) for chunk in chunks]
        if config.bf16:
            chunks = [Float16Module(config, chunk) for chunk in chunks]
        self.model = data_parallel.wrap(config, layout, chunks, model.share_embeddings_and_output_weights)
        ddp_config = self.model[0].ddp_config
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                bf16=config.bf16,
                params_dtype=config.params_dtype,
                use_distributed_optimizer=layout.distributed_optimizer,
                **optimizer,
            ),
            self.model,
        )
        config.finalize_model_grads_func = finalize_model_grads
        if ddp_config.overlap_grad_reduce:  # as Megatron-LM's training loop wires it
            no_sync = [chunk.no_sync for chunk in self.model]
            grad_sync = [chunk.start_grad_sync for chunk in self.model]
            config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
            config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
        self.pipeline_kwargs = pipeline_communication(self.chunks, config) if siamese_p2p else {}

    @property
    def chunks(self) -> List[torch.nn.Module]:
        """The GPTModel chunks themselves (inside their wrappers)."""
        return [unwrap(chunk) for chunk in self.model]

    def train(self, mode: bool = True) -> None:
        for chunk in self.model:
            chunk.train(mode)

    def zero_grad(self) -> None:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def forward_backward(self, microbatches: List[Dict[str, Tensor]], forward_only: bool = False,
                         step: Callable = forward_step) -> List[dict]:
        """Megatron's schedule over this rank's microbatches; the loss dicts on the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        iterators = [iter(microbatches) for _ in self.model]
        return get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=len(microbatches),
            # the microbatches' own shape (a packed row of documents: [1, b s], not [b, s])
            seq_length=microbatches[0]["tokens"].shape[1],
            micro_batch_size=microbatches[0]["tokens"].shape[0],
            forward_only=forward_only,
            **self.pipeline_kwargs,
        )

    @staticmethod
    def close() -> None:
        """Tear down Megatron's process groups (the next run in this process builds its own)."""
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
