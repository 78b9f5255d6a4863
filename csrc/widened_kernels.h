// The kernel interface of dual_norm.h (weights in their own dtype, one weight-gradient tensor per
// weight in its dtype) over kernels that take weights widened to the accumulation type and write
// weight gradients into one zeroed accumulation-type buffer (CudaAccKernels: the CUDA kernels today). The widening and the narrowing are tensor operations on the device, a few
// per op; the CPU kernels read and write the weights' own dtypes themselves and need none of this.
#pragma once

#include <ATen/TensorOperators.h>

#include <vector>

#include "dual_norm.h"

namespace megatron_siamese {

// ``w`` with every weight in the accumulation type and every gamma (not c1) as 1 + w.
inline NormWeights widened(const NormWeights& w, at::ScalarType acc) {
  auto widen = [&](const torch::Tensor& t, bool gamma) -> torch::Tensor {
    if (!t.defined()) return t;
    torch::Tensor out = t.to(acc);
    return gamma && w.zero_centered ? out + 1 : out;
  };
  NormWeights a = w;
  a.x_gamma = widen(w.x_gamma, !w.channel_scale), a.x_beta = widen(w.x_beta, false);
  a.y_gamma = widen(w.y_gamma, true), a.y_beta = widen(w.y_beta, false);
  a.in_gamma = widen(w.in_gamma, true), a.in_beta = widen(w.in_beta, false);
  a.prev_gamma = widen(w.prev_gamma, true), a.prev_beta = widen(w.prev_beta, false);
  a.zero_centered = false;
  return a;
}

// ``r`` with its bias in the accumulation type.
inline ResidualInputs widened(const ResidualInputs& r, at::ScalarType acc) {
  ResidualInputs a = r;
  if (a.bias.defined()) a.bias = a.bias.to(acc);
  return a;
}

// Each defined weight_grads[i] from row i of the accumulation-type buffer.
inline void narrow_rows(const torch::Tensor& rows, std::vector<torch::Tensor>& weight_grads) {
  for (size_t i = 0; i < weight_grads.size(); ++i)
    if (weight_grads[i].defined()) weight_grads[i].copy_(rows[static_cast<int64_t>(i)]);
}

template <class Acc>
struct WidenedKernels {
  static void dual_norm(const torch::Tensor& streams, const StreamRows& g, const NormWeights& w, double eps,
                        torch::Tensor& base, torch::Tensor& normed, torch::Tensor& stats) {
    Acc::dual_norm(streams, g, widened(w, accumulation_type(streams)), eps, base, normed, stats);
  }

  static void dual_norm_backward(const torch::Tensor& grad_base, const torch::Tensor& grad_normed,
                                 const torch::Tensor& streams, const torch::Tensor& stats, const StreamRows& g,
                                 const NormWeights& w, torch::Tensor& grad_streams,
                                 std::vector<torch::Tensor>& weight_grads) {
    const auto acc = accumulation_type(streams);
    torch::Tensor rows = torch::zeros({6, g.hidden}, streams.options().dtype(acc));
    Acc::dual_norm_backward(grad_base, grad_normed, streams, stats, g, widened(w, acc), grad_streams, rows);
    narrow_rows(rows, weight_grads);
  }

  static void dual_residual(const torch::Tensor& base, const torch::Tensor& out, const torch::Tensor& bias,
                            const torch::Tensor& mask, double scale, double inv_c, torch::Tensor& packed) {
    Acc::dual_residual(base, out, bias.defined() ? bias.to(accumulation_type(out)) : bias, mask, scale, inv_c, packed);
  }

  static void dual_residual_backward(const torch::Tensor& grad, const torch::Tensor& mask, double scale,
                                     double inv_c, torch::Tensor& grad_out, torch::Tensor& grad_bias) {
    torch::Tensor acc_bias;
    if (grad_bias.defined()) acc_bias = torch::zeros_like(grad_bias, grad.options().dtype(accumulation_type(grad)));
    Acc::dual_residual_backward(grad, mask, scale, inv_c, grad_out, acc_bias);
    if (grad_bias.defined()) grad_bias.copy_(acc_bias);
  }

  static void residual_dual_norm(const torch::Tensor& streams, const ResidualInputs& r, const StreamRows& g,
                                 const NormWeights& w, double eps, torch::Tensor& base, torch::Tensor& normed,
                                 torch::Tensor& stats) {
    const auto acc = accumulation_type(streams);
    Acc::residual_dual_norm(streams, widened(r, acc), g, widened(w, acc), eps, base, normed, stats);
  }

  static void residual_dual_norm_backward(const torch::Tensor& grad_base, const torch::Tensor& grad_normed,
                                          const torch::Tensor& streams, const ResidualInputs& r,
                                          const torch::Tensor& stats, const StreamRows& g, const NormWeights& w,
                                          torch::Tensor& grad_streams, torch::Tensor& grad_out,
                                          torch::Tensor& grad_bias, std::vector<torch::Tensor>& weight_grads) {
    const auto acc = accumulation_type(streams);
    const auto options = streams.options().dtype(acc);
    torch::Tensor rows = torch::zeros({kBoundaryWeightGrads, g.hidden}, options);
    torch::Tensor acc_bias = r.bias.defined() ? torch::zeros({g.hidden}, options) : torch::Tensor();
    Acc::residual_dual_norm_backward(grad_base, grad_normed, streams, widened(r, acc), stats, g, widened(w, acc),
                                     grad_streams, grad_out, acc_bias, rows);
    narrow_rows(rows, weight_grads);
    if (grad_bias.defined()) grad_bias.copy_(acc_bias);
  }
};

using CudaKernels = WidenedKernels<CudaAccKernels>;

}  // namespace megatron_siamese
