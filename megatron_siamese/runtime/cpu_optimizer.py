"""Megatron's optimizer on the CPU shim (cpu_shim.py installs these): the torch optimizers and
Megatron's own torch implementations of the gradient norm, clipping and scaling, also where
Transformer Engine or apex is installed."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch


def replacements() -> Dict[Tuple[Any, str], Any]:
    """TE's or apex's fused optimizers and multi-tensor kernels are CUDA kernels wherever TE or apex
    imports, even without a usable GPU: the torch optimizers and Megatron's own torch fallbacks instead."""
    import importlib

    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as optimizer_module

    optimizers = importlib.import_module("megatron.core.optimizer")  # the package; its name is shadowed above
    found = {(optimizers, "USING_PYTORCH_OPTIMIZER"): True, (optimizers, "Adam"): torch.optim.AdamW,
             (optimizers, "SGD"): torch.optim.SGD}
    local = {"multi_tensor_applier": utils.local_multi_tensor_applier,
             "l2_norm_impl": utils.local_multi_tensor_l2_norm,
             "multi_tensor_scale_impl": utils.local_multi_tensor_scale}
    found.update({(module, name): function for module in (clip_grads, optimizer_module)
                  for name, function in local.items() if hasattr(module, name)})
    return found
