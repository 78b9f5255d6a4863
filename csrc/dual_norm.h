// SiameseNorm fused ops: shared declarations for the CPU and CUDA implementations.
//
// The math is megatron_siamese/reference/functional.py; per sublayer, with the two
// streams stored packed as rows [x | y] of width 2h (or one row x = y of width h, at the
// first layer):
//
//   dual_norm:     u = PostNorm(x);  a = u + PreNorm(y);  normed = InputNorm(a) (or a)
//                  outputs base = [u | y] (2h), normed (h), stats (6 fp32 per row)
//   dual_residual: out_packed = base + [z / c | z],  z = (out + bias) * mask * scale
//
// "base" is what the residual update adds to. Returning it as one packed tensor lets the
// residual op's backward hand dual_norm's backward the identity-path gradient of y
// without a copy: grad_base is exactly the gradient of the packed output.
#pragma once

#include <torch/types.h>

#include <tuple>

namespace megatron_siamese {

// Per-row fp32 statistics: mean and rstd of x, y and a (means are 0 for RMSNorm).
constexpr int64_t kStatsPerRow = 6;

struct NormWeights {
  // In the accumulation type (fp32; fp64 for double streams), contiguous; bias and
  // input-norm tensors may be undefined.
  torch::Tensor x_weight, x_bias, y_weight, y_bias, in_weight, in_bias;
  bool rms = false;
  bool zero_centered_gamma = false;
  bool has_input_norm() const { return in_weight.defined(); }
};

// Row geometry of the packed streams.
struct StreamRows {
  int64_t rows = 0;    // N
  int64_t hidden = 0;  // h
  bool packed = true;  // rows are [x | y] (2h wide); false: a single stream x = y (h wide)
  int64_t width() const { return packed ? 2 * hidden : hidden; }
};

// float for float/bfloat16/half, double for double: where statistics and weight gradients live.
inline at::ScalarType accumulation_type(const torch::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

StreamRows check_streams(const torch::Tensor& streams, int64_t hidden);
void check_backward_inputs(const torch::Tensor& grad_base, const torch::Tensor& grad_normed,
                           const torch::Tensor& stats, const torch::Tensor& streams,
                           const StreamRows& geometry);
void check_residual(const torch::Tensor& base, const torch::Tensor& out,
                    const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& mask);
void check_residual_grad(const torch::Tensor& grad, const c10::optional<torch::Tensor>& mask);
NormWeights accumulation_weights(const torch::Tensor& x_weight, const c10::optional<torch::Tensor>& x_bias,
                         const torch::Tensor& y_weight, const c10::optional<torch::Tensor>& y_bias,
                         const c10::optional<torch::Tensor>& in_weight,
                         const c10::optional<torch::Tensor>& in_bias, int64_t hidden, bool rms,
                         bool zero_centered_gamma, at::ScalarType accumulation);

}  // namespace megatron_siamese
