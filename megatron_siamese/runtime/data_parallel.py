"""Model chunks wrapped for data parallelism as the layout says, with Megatron's own wrappers:
``DistributedDataParallel``, ``TorchFullyShardedDataParallel`` (torch FSDP2) or Megatron-FSDP's
``FullyShardedDataParallel``, configured as Megatron-LM's ``get_model`` does.

Two departures: a model with tied embeddings keeps the embedding in FSDP2's root unit (Megatron's
units would reshard it before the output layer reads it), and megatron-core < 0.19's FSDP2 wrapper
gets the ``force_all_reduce`` keyword (NVIDIA/Megatron-LM#4669, fixed by #4953). On gloo, no
``PREMUL_SUM``: ``gradient_reduce_div_fusion=False``. docs/parallelism.md, "Fully sharded data parallelism".
"""

from __future__ import annotations

import inspect
from typing import List

import torch

from megatron_siamese import device
from megatron_siamese.runtime.layout import Layout


def _torch_fsdp_class():
    """Megatron's TorchFullyShardedDataParallel, with 0.19's ``finish_grad_sync`` signature."""
    from megatron.core.distributed import TorchFullyShardedDataParallel

    if "force_all_reduce" in inspect.signature(TorchFullyShardedDataParallel.finish_grad_sync).parameters:
        return TorchFullyShardedDataParallel

    class TorchFSDP(TorchFullyShardedDataParallel):
        """megatron-core 0.16-0.18's wrapper, taking the keyword ``finalize_model_grads`` passes."""

        def finish_grad_sync(self, force_all_reduce: bool = False):
            super().finish_grad_sync()

    return TorchFSDP


def torch_fsdp_units(cls, shares_embeddings: bool) -> set:
    """The module classes Megatron's torch-FSDP2 wrapper shards as units of their own: its
    default, less the embedding when the output layer shares its weight (module docstring)."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    default = set(inspect.signature(cls.__init__).parameters["sub_modules_to_wrap"].default)
    return default - {LanguageModelEmbedding} if shares_embeddings else default


def ddp_config(layout: Layout):
    """The chunks' DistributedDataParallelConfig (its subclass for torch FSDP2), as Megatron-LM builds it."""
    from megatron.core.distributed import DistributedDataParallelConfig

    if layout.fsdp == "torch":
        from megatron.core.distributed import TorchFullyShardedDataParallelConfig

        return TorchFullyShardedDataParallelConfig(reshard_after_forward=True)
    megatron_fsdp = dict(use_megatron_fsdp=True, data_parallel_sharding_strategy=layout.fsdp_sharding,
                         gradient_reduce_div_fusion=device.uses_cuda())
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=layout.dp > 1,
        use_distributed_optimizer=layout.distributed_optimizer,
        **(megatron_fsdp if layout.fsdp == "megatron" else {}),
    )


def wrap(config, layout: Layout, chunks: List[torch.nn.Module], shares_embeddings: bool) -> List[torch.nn.Module]:
    """Each chunk in the layout's data-parallel wrapper (bucketing for the first chunk only, as
    Megatron-LM does: the later chunks' communication overlaps compute anyway)."""
    settings = ddp_config(layout)
    if layout.fsdp == "torch":
        cls = _torch_fsdp_class()
        units = torch_fsdp_units(cls, shares_embeddings)
        return [cls(config, settings, chunk, sub_modules_to_wrap=units) for chunk in chunks]
    if layout.fsdp == "megatron":
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel as cls
    else:
        from megatron.core.distributed import DistributedDataParallel as cls
    return [cls(config, settings, chunk, disable_bucketing=(i > 0)) for i, chunk in enumerate(chunks)]
