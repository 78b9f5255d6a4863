#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

namespace megatron_siamese {

// Which CUDA kernels run: "verified" (the default: the kernels that passed every CUDA test on
// an H200, 2026-12-01) or "tiled" (tiled_kernels.cu, with general_kernels.cuh for what they do
// not cover; chosen explicitly until a GPU run has verified this build). Read on every call
// from MEGATRON_SIAMESE_CUDA_KERNELS (docs/kernels.md).
enum class KernelGeneration { kVerified, kTiled };
inline const char* kCudaKernelsVariable = "MEGATRON_SIAMESE_CUDA_KERNELS";

inline KernelGeneration cuda_kernel_generation() {
  const char* value = std::getenv(kCudaKernelsVariable);
  const std::string name = value == nullptr ? "" : value;
  if (name.empty() || name == "verified") return KernelGeneration::kVerified;
  if (name == "tiled") return KernelGeneration::kTiled;
  TORCH_CHECK(false, kCudaKernelsVariable, " must be 'verified' (the default) or 'tiled' (the new kernels, ",
              "not yet run on a GPU); got '", name, "'");
}

}  // namespace megatron_siamese
