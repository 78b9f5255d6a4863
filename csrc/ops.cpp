// Operator schemas for torch.library, argument checks shared by the CPU and CUDA kernels,
// and the (empty) pybind11 module that makes the extension importable.
//
// Python registers fake (meta) implementations and autograd for these ops
// (megatron_siamese/ops/fused.py), so torch.compile traces through them and
// torch.library.opcheck can validate them, as in pytorch/extension-cpp.
#include <torch/extension.h>
#include <torch/library.h>

#include "dual_norm.h"

namespace megatron_siamese {

StreamRows check_streams(const torch::Tensor& streams, int64_t hidden) {
  TORCH_CHECK(streams.dim() == 2, "dual_norm: streams must be 2-D [rows, width], got ",
              streams.sizes());
  TORCH_CHECK(streams.is_contiguous(), "dual_norm: streams must be contiguous");
  TORCH_CHECK(hidden > 0, "dual_norm: hidden must be positive, got ", hidden);
  const int64_t width = streams.size(1);
  TORCH_CHECK(width == hidden || width == 2 * hidden,
              "dual_norm: streams width must be hidden (first layer) or 2 * hidden (packed "
              "[x | y]); got width ",
              width, " for hidden ", hidden);
  auto dtype = streams.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble,
              "dual_norm: streams must be float32, bfloat16, float16 or float64, got ", dtype);
  return StreamRows{streams.size(0), hidden, width == 2 * hidden};
}

void check_backward_inputs(const torch::Tensor& grad_base, const torch::Tensor& grad_normed,
                           const torch::Tensor& stats, const torch::Tensor& streams,
                           const StreamRows& geometry) {
  TORCH_CHECK(grad_base.dim() == 2 && grad_base.size(0) == geometry.rows &&
                  grad_base.size(1) == 2 * geometry.hidden,
              "dual_norm_backward: grad_base must be [rows, 2 * hidden], got ", grad_base.sizes());
  TORCH_CHECK(grad_normed.dim() == 2 && grad_normed.size(0) == geometry.rows &&
                  grad_normed.size(1) == geometry.hidden,
              "dual_norm_backward: grad_normed must be [rows, hidden], got ", grad_normed.sizes());
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == geometry.rows && stats.size(1) == kStatsPerRow &&
                  stats.scalar_type() == accumulation_type(streams) && stats.is_contiguous(),
              "dual_norm_backward: stats must be the forward's [rows, 6] statistics");
  TORCH_CHECK(grad_base.device() == streams.device() && grad_normed.device() == streams.device(),
              "dual_norm_backward: tensors must be on one device");
}

void check_residual(const torch::Tensor& base, const torch::Tensor& out,
                    const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& mask) {
  TORCH_CHECK(out.dim() == 2 && base.dim() == 2 && base.size(0) == out.size(0) &&
                  base.size(1) == 2 * out.size(1),
              "dual_residual: base must be [rows, 2h] and out [rows, h]; got ", base.sizes(), " and ",
              out.sizes());
  TORCH_CHECK(base.scalar_type() == out.scalar_type(), "dual_residual: base and out dtypes differ");
  TORCH_CHECK(base.device() == out.device(), "dual_residual: base and out are on different devices");
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out.size(1), "dual_residual: bias must be [h]");
  if (mask.has_value() && mask->defined())
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->sizes() == out.sizes(),
                "dual_residual: mask must be bool with out's shape");
}

void check_residual_grad(const torch::Tensor& grad, const c10::optional<torch::Tensor>& mask) {
  TORCH_CHECK(grad.dim() == 2 && grad.size(1) % 2 == 0,
              "dual_residual_backward: grad must be [rows, 2h], got ", grad.sizes());
  if (mask.has_value() && mask->defined())
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->size(0) == grad.size(0) &&
                    mask->size(1) * 2 == grad.size(1),
                "dual_residual_backward: mask must be bool [rows, h]");
}

static torch::Tensor weight_vector(const torch::Tensor& t, int64_t hidden, const char* name,
                                   at::ScalarType accumulation) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == hidden, "dual_norm: ", name, " must have shape [",
              hidden, "], got ", t.sizes());
  return t.to(accumulation).contiguous();
}

static torch::Tensor optional_weight(const c10::optional<torch::Tensor>& t, int64_t hidden,
                                     const char* name, at::ScalarType accumulation) {
  return t.has_value() && t->defined() ? weight_vector(*t, hidden, name, accumulation) : torch::Tensor();
}

NormWeights accumulation_weights(const torch::Tensor& x_weight, const c10::optional<torch::Tensor>& x_bias,
                         const torch::Tensor& y_weight, const c10::optional<torch::Tensor>& y_bias,
                         const c10::optional<torch::Tensor>& in_weight,
                         const c10::optional<torch::Tensor>& in_bias, int64_t hidden, bool rms,
                         bool zero_centered_gamma, at::ScalarType accumulation) {
  NormWeights w;
  w.x_weight = weight_vector(x_weight, hidden, "x_weight", accumulation);
  w.y_weight = weight_vector(y_weight, hidden, "y_weight", accumulation);
  w.x_bias = optional_weight(x_bias, hidden, "x_bias", accumulation);
  w.y_bias = optional_weight(y_bias, hidden, "y_bias", accumulation);
  w.in_weight = optional_weight(in_weight, hidden, "in_weight", accumulation);
  w.in_bias = optional_weight(in_bias, hidden, "in_bias", accumulation);
  w.rms = rms;
  w.zero_centered_gamma = zero_centered_gamma;
  const bool biased = w.x_bias.defined();
  TORCH_CHECK(biased == w.y_bias.defined() && (!w.has_input_norm() || biased == w.in_bias.defined()),
              "dual_norm: give biases for all norms or for none");
  TORCH_CHECK(!(rms && biased), "dual_norm: RMSNorm has no bias");
  TORCH_CHECK(w.has_input_norm() || !w.in_bias.defined(), "dual_norm: in_bias without in_weight");
  return w;
}

}  // namespace megatron_siamese

TORCH_LIBRARY(megatron_siamese, m) {
  // streams [N, 2h] packed [x | y] (or [N, h]: x = y). Returns base [N, 2h] = [u | y],
  // normed [N, h] = InputNorm(u + PreNorm(y)) (= u + PreNorm(y) without in_weight), and
  // stats [N, 6] for the backward (fp32; fp64 for double streams).
  m.def(
      "dual_norm(Tensor streams, int hidden, Tensor x_weight, Tensor? x_bias, Tensor y_weight, "
      "Tensor? y_bias, Tensor? in_weight, Tensor? in_bias, float eps, bool rms, "
      "bool zero_centered_gamma) -> (Tensor base, Tensor normed, Tensor stats)");
  // Gradients w.r.t. streams, and weight gradients [6, h] (fp32; fp64 for double) in the order x_weight,
  // x_bias, y_weight, y_bias, in_weight, in_bias (rows of absent tensors are zero).
  m.def(
      "dual_norm_backward(Tensor grad_base, Tensor grad_normed, Tensor streams, Tensor stats, "
      "int hidden, Tensor x_weight, Tensor? x_bias, Tensor y_weight, Tensor? y_bias, "
      "Tensor? in_weight, Tensor? in_bias, bool rms, bool zero_centered_gamma) -> "
      "(Tensor grad_streams, Tensor weight_grads)");
  // out_packed = base + [z * inv_c | z], z = (out + bias) * mask * scale.
  m.def(
      "dual_residual(Tensor base, Tensor out, Tensor? bias, Tensor? mask, float scale, "
      "float inv_c) -> Tensor");
  // (grad_out, grad_bias) from the packed output's gradient; grad_bias is fp32 (fp64) [h] (empty
  // when has_bias is false). grad_base is the incoming gradient itself.
  m.def(
      "dual_residual_backward(Tensor grad, Tensor? mask, float scale, float inv_c, "
      "bool has_bias) -> (Tensor grad_out, Tensor grad_bias)");
}

// The ops are reached through torch.ops.megatron_siamese; importing this module loads them.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
