"""The fused SiameseNorm ops from csrc/, as torch.library custom ops (``torch.ops.megatron_siamese.*``).

Defined in C++ (csrc/ops.cpp: CPU and, when built with CUDA, CUDA kernels; autograd in
csrc/autograd.cpp); ``ops.fused`` registers their fakes, for ``opcheck`` and ``torch.compile``.
docs/kernels.md.
"""

from __future__ import annotations

import functools
import platform
from typing import Optional

import torch


@functools.lru_cache(maxsize=None)
def load_error() -> Optional[str]:
    """None when the extension is loaded (and its ops registered), else why not."""
    if platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() not in (
        "AVX2",
        "AVX512",
    ):
        return "the CPU kernels are built for AVX2 and this CPU lacks it"
    try:
        from megatron_siamese import _C  # noqa: F401  (loading it registers the ops)
    except ImportError as error:
        return (
            f"the megatron_siamese._C extension is not built ({error}); install the package with "
            "`pip install --no-build-isolation -e .`"
        )
    from megatron_siamese.ops import fused  # noqa: F401  (the fake registrations)

    return None


CUDA_KERNELS_VARIABLE = "MEGATRON_SIAMESE_CUDA_KERNELS"
CUDA_KERNEL_GENERATIONS = ("verified", "tiled")


def cuda_kernel_generation() -> str:
    """Which CUDA kernels the ops run: "verified" (the default: passed every CUDA test on an H200) or
    "tiled" (MEGATRON_SIAMESE_CUDA_KERNELS=tiled until a GPU run verifies it). Read by the extension per call."""
    from megatron_siamese import _C

    return _C.cuda_kernel_generation()


def has_cuda_kernels() -> bool:
    return load_error() is None and torch._C._dispatch_has_kernel_for_dispatch_key(
        "megatron_siamese::dual_norm", "CUDA"
    )


def unavailable_reason(device_type: str) -> Optional[str]:
    """Why the fused ops cannot run on ``device_type`` ('cpu' or 'cuda'), or None."""
    error = load_error()
    if error is not None:
        return error
    if device_type == "cuda" and not has_cuda_kernels():
        return (
            "the extension was built without CUDA kernels (torch without CUDA, or no CUDA "
            "toolkit at build time); rebuild with `pip install --no-build-isolation -e .` on a "
            "CUDA machine"
        )
    return None
