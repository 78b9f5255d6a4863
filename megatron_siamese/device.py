"""Where this process computes: CUDA when torch sees a GPU, else the CPU. Decided here once.

Nothing else asks ``torch.cuda.is_available()``, so a process has one answer, and CPU runs never rely on
the CPU shim's redirection of ``torch.cuda.current_device()`` to place a tensor.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def uses_cuda() -> bool:
    """Whether this process computes on CUDA."""
    return torch.cuda.is_available()


def current() -> torch.device:
    """The device this rank's tensors live on: its GPU, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if uses_cuda() else torch.device("cpu")


def backend() -> str:
    """The torch.distributed backend for this device: NCCL on GPUs, gloo on CPU."""
    return "nccl" if uses_cuda() else "gloo"


def gpu_count() -> int:
    return torch.cuda.device_count() if uses_cuda() else 0
