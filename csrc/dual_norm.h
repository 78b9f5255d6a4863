// SiameseNorm fused ops: what the host layer (ops.cpp) hands the per-device kernels.
//
// The math is megatron_siamese/reference/functional.py; per sublayer, with the two
// streams stored packed as rows [x | y] of width 2h (or one row x = y of width h, at the
// first layer):
//
//   dual_norm:     u = PostNorm(x);  a = u + PreNorm(y);  normed = InputNorm(a) (or a)
//                  outputs base = [u | y] (2h), normed (h), stats (6 fp32 per row)
//   hybrid_dual_norm (the hybrid variant's attention side): the same with PostNorm replaced
//                  by a per-channel scale c1 and no InputNorm: normed = c1 * x + PreNorm(y),
//                  base = [x | y] (the X stream continues from x itself)
//   dual_residual: out_packed = base + [z / c | z],  z = (out + bias) * mask * scale
//
// and, between the sublayers of one layer (docs/kernels.md, "Boundary ops"):
//
//   entry_norm / hybrid_entry_norm: dual_norm's (hybrid_dual_norm's) normed and stats without
//                  base: the layer's first sublayer, whose residual the boundary op recomputes
//                  from the streams, which pass through (their gradient comes back to the
//                  entry op's backward and is added there, after the norms' backward)
//   residual_dual_norm: u = PostNorm_prev(x) (x itself for the hybrid attention side);
//                  x' = u + z / c, y' = y + z; then dual_norm of [x' | y']: base, normed,
//                  stats (8 per row: x's, then dual_norm's six)
//
// "base" is what the residual update adds to. Returning it as one packed tensor lets the
// residual op's backward hand the norm op's backward the identity-path gradient of y
// without a copy: grad_base is exactly the gradient of the packed output.
//
// ops.cpp checks every argument, prepares the weights, allocates the outputs and returns
// early on empty inputs; a device's kernels (CpuKernels in dual_norm_cpu.cpp and
// residual_norm_cpu.cpp, CudaKernels in dual_norm_cuda.cu) only launch on checked,
// contiguous, non-empty tensors.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "kernel_generation.h"

// torch::Tensor, torch::empty, ... as torch/types.h names them, without the whole of ATen that it
// includes: the CPU sources compile in about 60% of the time, the CUDA ones in 65-85% (nvcc parses
// the headers once per pass)
namespace torch {
using namespace at;  // NOLINT(google-build-using-namespace): torch/types.h's own declaration
}  // namespace torch

namespace megatron_siamese {

// Per-row fp32 statistics: mean and rstd of x, y and a (means are 0 for RMSNorm).
constexpr int64_t kStatsPerRow = 6;
// residual_dual_norm's: mean and rstd of the previous sublayer's x (0 and 1 without its
// PostNorm), then dual_norm's six for [x' | y'].
constexpr int64_t kBoundaryStatsPerRow = 8;
// residual_dual_norm's weight gradients: PostNorm_prev's gamma and beta, then dual_norm's six.
constexpr int64_t kBoundaryWeightGrads = 8;

// The norms' affine parameters as the ops received them: contiguous, each in its own dtype (the
// streams' or float32), gammas stored zero-centred when ``zero_centered`` (applied as 1 + w).
// Betas (and the input norm) may be undefined. The CPU kernels read them so; the CUDA kernels
// still take them widened (``widened``, WidenedKernels below).
//
// channel_scale: hybrid_dual_norm's X side. x_gamma is c1 (stored as is, not zero-centred),
// x_beta and the input norm are undefined, and x is not normalized: its statistics are the
// identity's (mean 0, rstd 1, written to stats as such), so u = c1 * x falls out of the same
// formulas, and the backward's x-norm terms vanish. base keeps x itself: the residual-path
// gradient of x reaches x directly, not through c1.
//
// base_is_streams: the entry ops, whose base is the streams themselves (never written): the
// gradient handed to the backward as grad_base is the streams' own ([rows, width]), added to x's
// and y's gradients after the norms' backward. prev_gamma / prev_beta: residual_dual_norm's
// PostNorm of the previous sublayer (undefined: the residual continues from x).
struct NormWeights {
  torch::Tensor x_gamma, x_beta, y_gamma, y_beta, in_gamma, in_beta;
  torch::Tensor prev_gamma, prev_beta;
  bool rms = false;
  bool zero_centered = false;  // every gamma (not c1) is stored as w, applied as 1 + w
  bool channel_scale = false;
  bool base_is_streams = false;
  bool has_input_norm() const { return in_gamma.defined(); }
  // base's x half is x itself: its gradient reaches x directly, not through PostNorm
  bool base_keeps_x() const { return channel_scale || base_is_streams; }
};

// NormWeights' tensors as pointers of the accumulation type A (null where undefined), for weights
// already widened to A.
template <typename A>
struct WeightPointers {
  const A *gx, *bx, *gy, *by, *gi, *bi;
};

template <typename A>
WeightPointers<A> pointers_of(const NormWeights& w) {
  auto p = [](const torch::Tensor& t) -> const A* { return t.defined() ? t.data_ptr<A>() : nullptr; };
  return {p(w.x_gamma), p(w.x_beta), p(w.y_gamma), p(w.y_beta), p(w.in_gamma), p(w.in_beta)};
}

// residual_dual_norm's residual: the sublayer's output, its bias (in its own dtype) and dropout
// mask (each may be undefined), the dropout scale and 1/c.
struct ResidualInputs {
  torch::Tensor out, bias, mask;
  double scale = 1.0, inv_c = 1.0;
};

// Row geometry of the packed streams.
struct StreamRows {
  int64_t rows = 0;    // N
  int64_t hidden = 0;  // h
  bool packed = true;  // rows are [x | y] (2h wide); false: a single stream x = y (h wide)
  int64_t width() const { return packed ? 2 * hidden : hidden; }
};

// The dtypes every kernel is instantiated for.
#define SIAMESE_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

// float for float/bfloat16/half, double for double: where statistics and weight gradients live.
inline at::ScalarType accumulation_type(const torch::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// One device's kernel launchers, for dual_norm and (NormWeights::channel_scale) for
// hybrid_dual_norm, their entry forms (base undefined in the forward; base_is_streams in the
// backward, whose grad_base is then [rows, width] or undefined), dual_residual and
// residual_dual_norm. Outputs are allocated by the host layer, uninitialized, and the kernels
// write all of them: base, normed and stats [rows, 6] ([rows, 8] for residual_dual_norm);
// grad_streams; weight_grads, one [h] tensor per weight slot in dual_norm's order (x_weight,
// x_bias, y_weight, y_bias, in_weight, in_bias; residual_dual_norm: prev_x_weight, prev_x_bias,
// then those six), each in its weight's dtype, undefined for absent weights; packed; grad_out;
// grad_bias [h] in the bias's dtype (undefined without a bias). Optional inputs (bias in its own
// dtype, mask, grad_base) may be undefined. ``WeightGrads``: std::vector<torch::Tensor>.
#define MEGATRON_SIAMESE_KERNELS(WeightGrads)                                                        \
  static void dual_norm(const torch::Tensor& streams, const StreamRows& g, const NormWeights& w,     \
                        double eps, torch::Tensor& base, torch::Tensor& normed, torch::Tensor& stats); \
  static void dual_norm_backward(const torch::Tensor& grad_base, const torch::Tensor& grad_normed,   \
                                 const torch::Tensor& streams, const torch::Tensor& stats,           \
                                 const StreamRows& g, const NormWeights& w,                          \
                                 torch::Tensor& grad_streams, WeightGrads& weight_grads);            \
  static void dual_residual(const torch::Tensor& base, const torch::Tensor& out,                     \
                            const torch::Tensor& bias, const torch::Tensor& mask, double scale,      \
                            double inv_c, torch::Tensor& packed);                                    \
  static void dual_residual_backward(const torch::Tensor& grad, const torch::Tensor& mask,           \
                                     double scale, double inv_c, torch::Tensor& grad_out,            \
                                     torch::Tensor& grad_bias);                                      \
  static void residual_dual_norm(const torch::Tensor& streams, const ResidualInputs& r,              \
                                 const StreamRows& g, const NormWeights& w, double eps,              \
                                 torch::Tensor& base, torch::Tensor& normed, torch::Tensor& stats);  \
  static void residual_dual_norm_backward(                                                          \
      const torch::Tensor& grad_base, const torch::Tensor& grad_normed, const torch::Tensor& streams, \
      const ResidualInputs& r, const torch::Tensor& stats, const StreamRows& g, const NormWeights& w, \
      torch::Tensor& grad_streams, torch::Tensor& grad_out, torch::Tensor& grad_bias,                \
      WeightGrads& weight_grads);

struct CpuKernels {
  MEGATRON_SIAMESE_KERNELS(std::vector<torch::Tensor>)
};

// The CUDA kernels' own interface (dual_norm_cuda.cu, residual_norm_cuda.cu; only in builds with
// CUDA), weight_grads a tensor: weights and bias widened to the accumulation type (gammas already
// 1 + w), the weight gradients into one [6, h] ([8, h]) accumulation-type tensor and grad_bias in
// the accumulation type, both zeroed. WidenedKernels (widened_kernels.h) gives them the interface above.
struct CudaAccKernels {
  MEGATRON_SIAMESE_KERNELS(torch::Tensor)
};

}  // namespace megatron_siamese
