#!/usr/bin/env bash
# The fused kernels on a CUDA machine, in one command (e.g. on one H200, a few minutes):
# build the CUDA extension, run the kernel tests on the GPU (they add a "cuda" parameter
# when the CUDA kernels are present), then the side-by-side bench at shapes far larger than L2.
#   bash bench/gpu/kernels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
python -m pip install -q --no-build-isolation --no-deps -e .
python -c "from megatron_siamese import ops; assert ops.has_cuda_kernels(), ops.unavailable_reason('cuda')"
python -m pytest -q tests/test_kernels.py
python bench/bench_dual_norm.py --device cuda --shapes 16384x4096,32768x8192,65536x2048 --dtypes bf16,fp32
