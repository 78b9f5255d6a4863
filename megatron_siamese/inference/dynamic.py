"""Megatron's dynamic inference engine (paged KV cache), for GPUs: ``generate --engine dynamic``.

Megatron attends over the paged cache only through flash-attn's CUDA kernels, so this runs on a GPU with
flash-attn >= 2.7.3 and is refused elsewhere. No GPU has run it yet: on CPU only its construction is tested.
docs/inference.md, "Which engine, on which megatron-core".
"""

from __future__ import annotations

import inspect
import math
from typing import Optional

import torch

BLOCK_SIZE_TOKENS = 256  # Megatron's default; flash-attn 2's paged kernels take multiples of 256


def has_dynamic_engine() -> bool:
    """Whether the installed megatron-core has the dynamic engine and its context."""
    try:
        from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext  # noqa: F401
        from megatron.core.inference.engines import DynamicInferenceEngine  # noqa: F401
    except ImportError:
        return False
    return True


def _has_paged_attention_kernel() -> bool:
    """Megatron's attention's check before a dynamic-batching step, without raising when flash-attn is absent."""
    from megatron.core.transformer import attention
    from megatron.core.utils import is_fa_min_version

    if getattr(attention, "HAVE_FA4", False) or getattr(attention, "HAVE_FA3", False):
        return True
    try:
        return bool(is_fa_min_version("2.7.3"))
    except (ImportError, ModuleNotFoundError):
        return False


def dynamic_engine_problem() -> Optional[str]:
    """Why ``--engine dynamic`` cannot run here (one line), or None."""
    import megatron.core

    from megatron_siamese import device

    if not has_dynamic_engine():
        return (f"megatron-core {megatron.core.__version__} has no dynamic inference engine: "
                "use --engine static")
    if not device.uses_cuda():
        return ("--engine dynamic needs a GPU: Megatron attends over its paged KV cache only with "
                "flash-attn's CUDA kernels (Attention.flash_decode_and_prefill); on CPU use --engine static")
    from megatron.core.transformer import attention

    if attention.rearrange is None:
        return "--engine dynamic needs einops (Megatron's dynamic-batching attention reshapes with it): pip install einops"
    if not _has_paged_attention_kernel():
        return ("--engine dynamic needs flash-attn >= 2.7.3 (or FA3), Megatron's paged-KV attention kernel: "
                "install it, or use --engine static")
    return None


def kv_buffer_gb(config, max_requests: int, max_sequence_length: int) -> float:
    """GiB of paged KV cache for ``max_requests`` sequences on this rank, plus Megatron's dummy block and a spare."""
    from megatron.core import parallel_state

    layers = config.num_layers // parallel_state.get_pipeline_model_parallel_world_size()
    kv_heads = (config.num_query_groups or config.num_attention_heads) // config.tensor_model_parallel_size
    block_bytes = 2 * layers * BLOCK_SIZE_TOKENS * kv_heads * config.kv_channels * config.params_dtype.itemsize
    blocks = max_requests * math.ceil(max_sequence_length / BLOCK_SIZE_TOKENS) + 2
    return blocks * block_bytes / 1024 ** 3


def dynamic_context(model, max_requests: int, max_sequence_length: int):
    """Megatron's DynamicInferenceContext for this rank's chunk, CUDA graphs and unified memory off."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    config = model.config
    buffer_gb = kv_buffer_gb(config, max_requests, max_sequence_length)
    options = dict(max_requests=max_requests, max_sequence_length=max_sequence_length, buffer_size_gb=buffer_gb,
                   block_size_tokens=BLOCK_SIZE_TOKENS, num_cuda_graphs=None, unified_memory_level=0,
                   use_flashinfer_fused_rope=False)
    if "inference_config" in inspect.signature(DynamicInferenceContext.__init__).parameters:  # megatron-core >= 0.19
        from megatron.core.inference.config import InferenceConfig

        return DynamicInferenceContext(config, InferenceConfig(**options))
    from megatron.core import parallel_state

    return DynamicInferenceContext(  # megatron-core 0.16: this rank's layers, the KV heads of the whole model
        params_dtype=config.params_dtype,
        num_layers=config.num_layers // parallel_state.get_pipeline_model_parallel_world_size(),
        kv_channels=config.kv_channels, num_attention_heads=config.num_query_groups or config.num_attention_heads,
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(), **options)


def dynamic_engine(controller, context, seed: int):
    """Megatron's DynamicInferenceEngine over ``controller`` and ``context``, CUDA graphs off."""
    from megatron.core.inference.engines import DynamicInferenceEngine

    if "random_seed" in inspect.signature(DynamicInferenceEngine.__init__).parameters:  # megatron-core 0.16
        return DynamicInferenceEngine(controller, context, enable_cuda_graph=False, random_seed=seed)
    return DynamicInferenceEngine(controller, context)  # 0.19: seeded from config.inference_sampling_seed


def generated_tokens(records) -> list:
    """Each finished request's generated token ids, in the order the prompts were added."""
    requests = [record.merge() if hasattr(record, "merge") else record for record in records]
    return [[int(t) for t in (r.generated_tokens.tolist() if torch.is_tensor(r.generated_tokens)
                              else r.generated_tokens)] for r in requests]
