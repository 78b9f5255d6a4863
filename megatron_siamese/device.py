"""Where this process computes: CUDA when torch sees a GPU, else the CPU. Decided here once.

Every module asks this one (never ``torch.cuda.is_available()`` itself), so "are we on a
GPU" has one answer per process, and CPU runs never depend on the CPU shim's redirection of
``torch.cuda.current_device()`` to put a tensor somewhere.
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
