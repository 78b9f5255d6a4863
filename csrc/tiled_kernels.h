// The tiled CUDA kernels (tiled_kernels.cu): several rows per CTA, a row over a group of
// threads holding it in registers, a persistent grid, weight-gradient accumulators only for
// the weights that exist and one partial per row group, summed in a fixed order.
//
// This interface takes raw pointers and includes nothing of torch, so tiled_kernels.cu
// compiles on its own in seconds (tests/test_launch_plan.py reads ptxas's resource figures
// for every instantiation from such a compile). dual_norm_cuda.cu calls it on checked,
// contiguous, aligned tensors (`aligned` below) and takes the general kernels otherwise.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "launch_plan.h"

namespace megatron_siamese {
namespace tiled {

enum class DType { kFloat, kBFloat16, kHalf };

inline int element_size(DType t) { return t == DType::kFloat ? 4 : 2; }
inline int vector_width(DType t) { return 16 / element_size(t); }  // 16-byte accesses

// True when every pointer is 16-byte aligned and rows of `hidden` elements keep them so:
// the condition for the tiled kernels' vector accesses.
inline bool aligned(DType t, int64_t hidden, std::initializer_list<const void*> pointers) {
  if (hidden % vector_width(t) != 0) return false;
  for (const void* p : pointers)
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// The norm weights as the kernels read them: fp32 [h], gamma already 1 + w where stored
// zero-centred; null where absent.
struct NormArgs {
  const void* streams = nullptr;
  int64_t rows = 0;
  int hidden = 0;
  bool packed = true;
  bool rms = false;
  float eps = 0;
  const float *gx = nullptr, *bx = nullptr, *gy = nullptr, *by = nullptr, *gi = nullptr, *bi = nullptr;
  bool biased() const { return bx != nullptr; }
  bool input_norm() const { return gi != nullptr; }
};

// The device's limits for plan::plan_rows (cached per device).
plan::Device device_limits(int device);

// Plans; `tiled == false` means no tiled instantiation covers the row (use the general kernel).
plan::Plan plan_forward(DType t, const NormArgs& a, int device);
plan::Plan plan_backward(DType t, const NormArgs& a, int device);
// Weight-gradient partial rows a backward plan writes: [parts, accumulators, hidden] fp32.
int backward_parts(const plan::Plan& p);
int backward_accumulators(const NormArgs& a);

// `device`: the current device, whose plan `p` is (the first launch of each configuration asks
// the driver to confirm the plan's occupancy).
void forward(const plan::Plan& p, DType t, const NormArgs& a, void* base, void* normed, float* stats, int device,
             cudaStream_t stream);
// partials: [backward_parts(p), backward_accumulators(a), hidden]; weight_grads [6, hidden]
// (rows of absent weights are left as they are).
void backward(const plan::Plan& p, DType t, const NormArgs& a, const void* grad_base, const void* grad_normed,
              const float* stats, void* grad_streams, float* partials, float* weight_grads, int device,
              cudaStream_t stream);

// dual_residual on aligned rows; bias (fp32) and mask may be null.
void residual(DType t, const void* base, const void* out, const float* bias, const bool* mask, float scale,
              float inv_c, int64_t rows, int hidden, void* packed, cudaStream_t stream);
// Row strips of the backward's bias-gradient partials: [residual_parts(...), hidden] fp32.
int residual_backward_parts(int64_t rows, int hidden, DType t, int device);
void residual_backward(DType t, const void* grad, const bool* mask, float scale, float inv_c, int64_t rows,
                       int hidden, void* grad_out, float* partials /* null without a bias */,
                       float* grad_bias, int device, cudaStream_t stream);

}  // namespace tiled
}  // namespace megatron_siamese
