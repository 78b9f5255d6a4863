// The one host layer of the SiameseNorm fused ops: operator schemas for torch.library, the
// argument checks, weight preparation, output allocation and empty-input handling, shared by
// every device; each device contributes only kernel launchers (dual_norm.h).
//
// Python registers fake (meta) implementations and autograd for these ops
// (megatron_siamese/ops/fused.py), so torch.compile traces through them and
// torch.library.opcheck can validate them, as in pytorch/extension-cpp.
#include <torch/extension.h>
#include <torch/library.h>

#include "dual_norm.h"
#include "launch_plan.h"

namespace megatron_siamese {
namespace {

using OptionalTensor = c10::optional<torch::Tensor>;

torch::Tensor defined_or_empty(const OptionalTensor& t) {
  return t.has_value() && t->defined() ? *t : torch::Tensor();
}

StreamRows check_streams(const torch::Tensor& streams, int64_t hidden, const char* op) {
  TORCH_CHECK(streams.dim() == 2, op, ": streams must be 2-D [rows, width], got ", streams.sizes());
  TORCH_CHECK(streams.is_contiguous(), op, ": streams must be contiguous");
  TORCH_CHECK(hidden > 0, op, ": hidden must be positive, got ", hidden);
  const int64_t width = streams.size(1);
  TORCH_CHECK(width == hidden || width == 2 * hidden, op,
              ": streams width must be hidden (first layer) or 2 * hidden (packed [x | y]); got width ", width,
              " for hidden ", hidden);
  auto dtype = streams.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble, op,
              ": streams must be float32, bfloat16, float16 or float64, got ", dtype);
  return StreamRows{streams.size(0), hidden, width == 2 * hidden};
}

// A weight vector as the kernels read it: [h], on the streams' device, in the accumulation
// type, contiguous; a gamma gets its +1 when stored zero-centred.
torch::Tensor prepared(const OptionalTensor& t, const torch::Tensor& streams, int64_t hidden, const char* op,
                       const char* name, bool is_gamma, bool zero_centered_gamma) {
  torch::Tensor w = defined_or_empty(t);
  if (!w.defined()) return w;
  TORCH_CHECK(w.dim() == 1 && w.size(0) == hidden, op, ": ", name, " must have shape [", hidden, "], got ",
              w.sizes());
  TORCH_CHECK(w.device() == streams.device(), op, ": ", name, " is on ", w.device(), ", the streams on ",
              streams.device());
  TORCH_CHECK(w.scalar_type() == streams.scalar_type() || w.scalar_type() == at::kFloat, op, ": ", name,
              " must be in the streams' dtype (", streams.scalar_type(), ") or float32, got ", w.scalar_type());
  w = w.to(accumulation_type(streams));
  return (is_gamma && zero_centered_gamma ? w + 1 : w).contiguous();
}

NormWeights prepare_weights(const torch::Tensor& streams, int64_t hidden, const torch::Tensor& x_weight,
                            const OptionalTensor& x_bias, const torch::Tensor& y_weight,
                            const OptionalTensor& y_bias, const OptionalTensor& in_weight,
                            const OptionalTensor& in_bias, bool rms, bool zero_centered_gamma) {
  constexpr const char* op = "dual_norm";
  NormWeights w;
  w.x_gamma = prepared(x_weight, streams, hidden, op, "x_weight", true, zero_centered_gamma);
  w.y_gamma = prepared(y_weight, streams, hidden, op, "y_weight", true, zero_centered_gamma);
  w.in_gamma = prepared(in_weight, streams, hidden, op, "in_weight", true, zero_centered_gamma);
  w.x_beta = prepared(x_bias, streams, hidden, op, "x_bias", false, false);
  w.y_beta = prepared(y_bias, streams, hidden, op, "y_bias", false, false);
  w.in_beta = prepared(in_bias, streams, hidden, op, "in_bias", false, false);
  w.rms = rms;
  const bool biased = w.x_beta.defined();
  TORCH_CHECK(biased == w.y_beta.defined() && (!w.has_input_norm() || biased == w.in_beta.defined()),
              "dual_norm: give biases for all norms or for none");
  TORCH_CHECK(!(rms && biased), "dual_norm: RMSNorm has no bias");
  TORCH_CHECK(w.has_input_norm() || !w.in_beta.defined(), "dual_norm: in_bias without in_weight");
  return w;
}

// hybrid_dual_norm's weights: c1 as the X side's gamma (a scale, ones at init: never
// zero-centred), PreNorm(y)'s gamma and bias, no input norm.
NormWeights prepare_hybrid_weights(const torch::Tensor& streams, int64_t hidden, const torch::Tensor& x_scale,
                                   const torch::Tensor& y_weight, const OptionalTensor& y_bias, bool rms,
                                   bool zero_centered_gamma) {
  constexpr const char* op = "hybrid_dual_norm";
  NormWeights w;
  w.x_gamma = prepared(x_scale, streams, hidden, op, "x_scale", false, false);
  w.y_gamma = prepared(y_weight, streams, hidden, op, "y_weight", true, zero_centered_gamma);
  w.y_beta = prepared(y_bias, streams, hidden, op, "y_bias", false, false);
  w.rms = rms;
  w.channel_scale = true;
  TORCH_CHECK(!(rms && w.y_beta.defined()), "hybrid_dual_norm: RMSNorm has no bias");
  return w;
}

// The forward of the norm ops on checked streams and prepared weights; the entry ops write no
// base (an undefined tensor).
template <class Kernels>
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> norm_forward(const torch::Tensor& streams,
                                                                     const StreamRows& geometry,
                                                                     const NormWeights& weights, double eps) {
  auto base = weights.base_is_streams ? torch::Tensor()
                                      : torch::empty({geometry.rows, 2 * geometry.hidden}, streams.options());
  auto normed = torch::empty({geometry.rows, geometry.hidden}, streams.options());
  auto stats = torch::empty({geometry.rows, kStatsPerRow}, streams.options().dtype(accumulation_type(streams)));
  if (geometry.rows > 0) Kernels::dual_norm(streams, geometry, weights, eps, base, normed, stats);
  return {base, normed, stats};
}

// Checks a gradient that the backward ops take beside the streams: [rows, cols], the streams'
// device and dtype. Optional ones (grad_base of the entry and boundary ops) may be undefined.
void check_gradient(const char* op, const char* name, const torch::Tensor& grad, const torch::Tensor& streams,
                    int64_t rows, int64_t cols, const char* shape) {
  if (!grad.defined()) return;
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == rows && grad.size(1) == cols, op, ": ", name, " must be ", shape,
              ", got ", grad.sizes());
  TORCH_CHECK(grad.device() == streams.device(), op, ": tensors must be on one device");
  TORCH_CHECK(grad.scalar_type() == streams.scalar_type(), op, ": ", name, " (", grad.scalar_type(),
              ") must be in the streams' dtype (", streams.scalar_type(), ")");
}

void check_stats(const char* op, const torch::Tensor& stats, const torch::Tensor& streams, int64_t rows,
                 int64_t per_row) {
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == rows && stats.size(1) == per_row &&
                  stats.scalar_type() == accumulation_type(streams) && stats.is_contiguous(),
              op, ": stats must be the forward's [rows, ", per_row, "] statistics");
  TORCH_CHECK(stats.device() == streams.device(), op, ": tensors must be on one device");
}

// The backward of the norm ops: grad_streams and weight gradients [6, h] in dual_norm's order.
// grad_base: base's gradient [rows, 2h], or for the entry ops (base_is_streams) the streams'
// pass-through gradient [rows, width], which may be undefined (no such path).
template <class Kernels>
std::tuple<torch::Tensor, torch::Tensor> norm_backward(const char* op, const torch::Tensor& grad_base,
                                                       const torch::Tensor& grad_normed, const torch::Tensor& streams,
                                                       const torch::Tensor& stats, const StreamRows& geometry,
                                                       const NormWeights& weights) {
  const int64_t hidden = geometry.hidden;
  if (weights.base_is_streams) {
    check_gradient(op, "grad_streams_through", grad_base, streams, geometry.rows, geometry.width(),
                   "the streams' shape");
  } else {
    TORCH_CHECK(grad_base.defined(), op, ": grad_base is required");
    check_gradient(op, "grad_base", grad_base, streams, geometry.rows, 2 * hidden, "[rows, 2 * hidden]");
  }
  TORCH_CHECK(grad_normed.defined(), op, ": grad_normed is required");
  check_gradient(op, "grad_normed", grad_normed, streams, geometry.rows, hidden, "[rows, hidden]");
  check_stats(op, stats, streams, geometry.rows, kStatsPerRow);
  auto gb = grad_base.defined() ? grad_base.contiguous() : grad_base;
  auto gn = grad_normed.contiguous();
  auto grad_streams = torch::empty_like(streams);
  auto weight_grads = torch::zeros({6, hidden}, streams.options().dtype(accumulation_type(streams)));
  if (geometry.rows > 0)
    Kernels::dual_norm_backward(gb, gn, streams, stats, geometry, weights, grad_streams, weight_grads);
  return {grad_streams, weight_grads};
}

// dual_norm's weight-gradient rows x_weight, y_weight, y_bias: the hybrid ops' c1, y_weight, y_bias
torch::Tensor hybrid_rows(const torch::Tensor& weight_grads) {
  const auto rows = torch::tensor({0, 2, 3}, weight_grads.options().dtype(at::kLong));
  return weight_grads.index_select(0, rows);
}

template <class Kernels>
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> dual_norm(
    const torch::Tensor& streams, int64_t hidden, const torch::Tensor& x_weight, const OptionalTensor& x_bias,
    const torch::Tensor& y_weight, const OptionalTensor& y_bias, const OptionalTensor& in_weight,
    const OptionalTensor& in_bias, double eps, bool rms, bool zero_centered_gamma) {
  const StreamRows geometry = check_streams(streams, hidden, "dual_norm");
  return norm_forward<Kernels>(streams, geometry,
                               prepare_weights(streams, hidden, x_weight, x_bias, y_weight, y_bias, in_weight,
                                               in_bias, rms, zero_centered_gamma),
                               eps);
}

template <class Kernels>
std::tuple<torch::Tensor, torch::Tensor> dual_norm_backward(
    const torch::Tensor& grad_base, const torch::Tensor& grad_normed, const torch::Tensor& streams,
    const torch::Tensor& stats, int64_t hidden, const torch::Tensor& x_weight, const OptionalTensor& x_bias,
    const torch::Tensor& y_weight, const OptionalTensor& y_bias, const OptionalTensor& in_weight,
    const OptionalTensor& in_bias, bool rms, bool zero_centered_gamma) {
  const StreamRows geometry = check_streams(streams, hidden, "dual_norm_backward");
  return norm_backward<Kernels>("dual_norm_backward", grad_base, grad_normed, streams, stats, geometry,
                                prepare_weights(streams, hidden, x_weight, x_bias, y_weight, y_bias, in_weight,
                                                in_bias, rms, zero_centered_gamma));
}

template <class Kernels>
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> hybrid_dual_norm(
    const torch::Tensor& streams, int64_t hidden, const torch::Tensor& x_scale, const torch::Tensor& y_weight,
    const OptionalTensor& y_bias, double eps, bool rms, bool zero_centered_gamma) {
  const StreamRows geometry = check_streams(streams, hidden, "hybrid_dual_norm");
  return norm_forward<Kernels>(
      streams, geometry, prepare_hybrid_weights(streams, hidden, x_scale, y_weight, y_bias, rms, zero_centered_gamma),
      eps);
}

template <class Kernels>
std::tuple<torch::Tensor, torch::Tensor> hybrid_dual_norm_backward(
    const torch::Tensor& grad_base, const torch::Tensor& grad_normed, const torch::Tensor& streams,
    const torch::Tensor& stats, int64_t hidden, const torch::Tensor& x_scale, const torch::Tensor& y_weight,
    const OptionalTensor& y_bias, bool rms, bool zero_centered_gamma) {
  const StreamRows geometry = check_streams(streams, hidden, "hybrid_dual_norm_backward");
  auto [grad_streams, weight_grads] = norm_backward<Kernels>(
      "hybrid_dual_norm_backward", grad_base, grad_normed, streams, stats, geometry,
      prepare_hybrid_weights(streams, hidden, x_scale, y_weight, y_bias, rms, zero_centered_gamma));
  return {grad_streams, hybrid_rows(weight_grads)};
}

template <class Kernels>
std::tuple<torch::Tensor, torch::Tensor> entry_norm(const torch::Tensor& streams, int64_t hidden,
                                                    const torch::Tensor& x_weight, const OptionalTensor& x_bias,
                                                    const torch::Tensor& y_weight, const OptionalTensor& y_bias,
                                                    const OptionalTensor& in_weight, const OptionalTensor& in_bias,
                                                    double eps, bool rms, bool zero_centered_gamma) {
  const StreamRows geometry = check_streams(streams, hidden, "entry_norm");
  NormWeights weights = prepare_weights(streams, hidden, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias, rms,
                                        zero_centered_gamma);
  weights.base_is_streams = true;
  auto [base, normed, stats] = norm_forward<Kernels>(streams, geometry, weights, eps);
  return {normed, stats};
}

template <class Kernels>
std::tuple<torch::Tensor, torch::Tensor> entry_norm_backward(
    const OptionalTensor& grad_streams_through, const torch::Tensor& grad_normed, const torch::Tensor& streams,
    const torch::Tensor& stats, int64_t hidden, const torch::Tensor& x_weight, const OptionalTensor& x_bias,
    const torch::Tensor& y_weight, const OptionalTensor& y_bias, const OptionalTensor& in_weight,
    const OptionalTensor& in_bias, bool rms, bool zero_centered_gamma) {
  const StreamRows geometry = check_streams(streams, hidden, "entry_norm_backward");
  NormWeights weights = prepare_weights(streams, hidden, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias, rms,
                                        zero_centered_gamma);
  weights.base_is_streams = true;
  return norm_backward<Kernels>("entry_norm_backward", defined_or_empty(grad_streams_through), grad_normed, streams,
                                stats, geometry, weights);
}

template <class Kernels>
std::tuple<torch::Tensor, torch::Tensor> hybrid_entry_norm(const torch::Tensor& streams, int64_t hidden,
                                                           const torch::Tensor& x_scale, const torch::Tensor& y_weight,
                                                           const OptionalTensor& y_bias, double eps, bool rms,
                                                           bool zero_centered_gamma) {
  const StreamRows geometry = check_streams(streams, hidden, "hybrid_entry_norm");
  NormWeights weights = prepare_hybrid_weights(streams, hidden, x_scale, y_weight, y_bias, rms, zero_centered_gamma);
  weights.base_is_streams = true;
  auto [base, normed, stats] = norm_forward<Kernels>(streams, geometry, weights, eps);
  return {normed, stats};
}

template <class Kernels>
std::tuple<torch::Tensor, torch::Tensor> hybrid_entry_norm_backward(
    const OptionalTensor& grad_streams_through, const torch::Tensor& grad_normed, const torch::Tensor& streams,
    const torch::Tensor& stats, int64_t hidden, const torch::Tensor& x_scale, const torch::Tensor& y_weight,
    const OptionalTensor& y_bias, bool rms, bool zero_centered_gamma) {
  const StreamRows geometry = check_streams(streams, hidden, "hybrid_entry_norm_backward");
  NormWeights weights = prepare_hybrid_weights(streams, hidden, x_scale, y_weight, y_bias, rms, zero_centered_gamma);
  weights.base_is_streams = true;
  auto [grad_streams, weight_grads] = norm_backward<Kernels>(
      "hybrid_entry_norm_backward", defined_or_empty(grad_streams_through), grad_normed, streams, stats, geometry,
      weights);
  return {grad_streams, hybrid_rows(weight_grads)};
}

// residual_dual_norm's inputs besides the streams: the sublayer's output, its bias (in the
// accumulation type) and dropout mask, checked against the streams.
struct ResidualInputs {
  torch::Tensor out, bias, mask;
};

ResidualInputs check_residual_inputs(const char* op, const torch::Tensor& streams, const StreamRows& g,
                                     const torch::Tensor& out, const OptionalTensor& bias, const OptionalTensor& mask) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == g.rows && out.size(1) == g.hidden, op, ": out must be [rows, hidden] = [",
              g.rows, ", ", g.hidden, "], got ", out.sizes());
  TORCH_CHECK(out.device() == streams.device(), op, ": out is on ", out.device(), ", the streams on ",
              streams.device());
  TORCH_CHECK(out.scalar_type() == streams.scalar_type(), op, ": out (", out.scalar_type(),
              ") must be in the streams' dtype (", streams.scalar_type(), ")");
  ResidualInputs r{out.contiguous(), defined_or_empty(bias), defined_or_empty(mask)};
  if (r.bias.defined()) {
    TORCH_CHECK(r.bias.dim() == 1 && r.bias.size(0) == g.hidden, op, ": bias must be [", g.hidden, "], got ",
                r.bias.sizes());
    TORCH_CHECK(r.bias.device() == streams.device(), op, ": bias is on ", r.bias.device(), ", the streams on ",
                streams.device());
    TORCH_CHECK(r.bias.scalar_type() == streams.scalar_type() || r.bias.scalar_type() == at::kFloat, op,
                ": bias must be in the streams' dtype (", streams.scalar_type(), ") or float32, got ",
                r.bias.scalar_type());
    r.bias = r.bias.to(accumulation_type(streams)).contiguous();
  }
  if (r.mask.defined()) {
    TORCH_CHECK(r.mask.scalar_type() == at::kBool && r.mask.dim() == 2 && r.mask.size(0) == g.rows &&
                    r.mask.size(1) == g.hidden,
                op, ": mask must be bool [rows, hidden]");
    TORCH_CHECK(r.mask.device() == streams.device(), op, ": mask is on ", r.mask.device(), ", the streams on ",
                streams.device());
    r.mask = r.mask.contiguous();
  }
  return r;
}

// The boundary op's weights: the previous sublayer's PostNorm (gamma and beta, or neither: the
// residual continues from x) and the next sublayer's three norms, as dual_norm takes them.
NormWeights prepare_boundary_weights(const char* op, const torch::Tensor& streams, int64_t hidden,
                                     const OptionalTensor& prev_x_weight, const OptionalTensor& prev_x_bias,
                                     const torch::Tensor& x_weight, const OptionalTensor& x_bias,
                                     const torch::Tensor& y_weight, const OptionalTensor& y_bias,
                                     const OptionalTensor& in_weight, const OptionalTensor& in_bias, bool rms,
                                     bool zero_centered_gamma) {
  NormWeights w = prepare_weights(streams, hidden, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias, rms,
                                  zero_centered_gamma);
  w.prev_gamma = prepared(prev_x_weight, streams, hidden, op, "prev_x_weight", true, zero_centered_gamma);
  w.prev_beta = prepared(prev_x_bias, streams, hidden, op, "prev_x_bias", false, false);
  TORCH_CHECK(w.prev_gamma.defined() || !w.prev_beta.defined(), op, ": prev_x_bias without prev_x_weight");
  TORCH_CHECK(!w.prev_gamma.defined() || w.prev_beta.defined() == w.x_beta.defined(), op,
              ": give biases for all norms or for none");
  return w;
}

template <class Kernels>
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> residual_dual_norm(
    const torch::Tensor& streams, const torch::Tensor& out, const OptionalTensor& bias, const OptionalTensor& mask,
    double scale, double inv_c, int64_t hidden, const OptionalTensor& prev_x_weight, const OptionalTensor& prev_x_bias,
    const torch::Tensor& x_weight, const OptionalTensor& x_bias, const torch::Tensor& y_weight,
    const OptionalTensor& y_bias, const OptionalTensor& in_weight, const OptionalTensor& in_bias, double eps, bool rms,
    bool zero_centered_gamma) {
  constexpr const char* op = "residual_dual_norm";
  const StreamRows g = check_streams(streams, hidden, op);
  const ResidualInputs r = check_residual_inputs(op, streams, g, out, bias, mask);
  const NormWeights w = prepare_boundary_weights(op, streams, hidden, prev_x_weight, prev_x_bias, x_weight, x_bias,
                                                 y_weight, y_bias, in_weight, in_bias, rms, zero_centered_gamma);
  auto base = torch::empty({g.rows, 2 * hidden}, streams.options());
  auto normed = torch::empty({g.rows, hidden}, streams.options());
  auto stats = torch::empty({g.rows, kBoundaryStatsPerRow}, streams.options().dtype(accumulation_type(streams)));
  if (g.rows > 0) Kernels::residual_dual_norm(streams, r.out, r.bias, r.mask, scale, inv_c, g, w, eps, base, normed, stats);
  return {base, normed, stats};
}

template <class Kernels>
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> residual_dual_norm_backward(
    const OptionalTensor& grad_base, const torch::Tensor& grad_normed, const torch::Tensor& streams,
    const torch::Tensor& out, const OptionalTensor& bias, const OptionalTensor& mask, const torch::Tensor& stats,
    double scale, double inv_c, int64_t hidden, const OptionalTensor& prev_x_weight, const OptionalTensor& prev_x_bias,
    const torch::Tensor& x_weight, const OptionalTensor& x_bias, const torch::Tensor& y_weight,
    const OptionalTensor& y_bias, const OptionalTensor& in_weight, const OptionalTensor& in_bias, bool rms,
    bool zero_centered_gamma) {
  constexpr const char* op = "residual_dual_norm_backward";
  const StreamRows g = check_streams(streams, hidden, op);
  const ResidualInputs r = check_residual_inputs(op, streams, g, out, bias, mask);
  const NormWeights w = prepare_boundary_weights(op, streams, hidden, prev_x_weight, prev_x_bias, x_weight, x_bias,
                                                 y_weight, y_bias, in_weight, in_bias, rms, zero_centered_gamma);
  const torch::Tensor gb = defined_or_empty(grad_base);
  check_gradient(op, "grad_base", gb, streams, g.rows, 2 * hidden, "[rows, 2 * hidden]");
  check_gradient(op, "grad_normed", grad_normed, streams, g.rows, hidden, "[rows, hidden]");
  check_stats(op, stats, streams, g.rows, kBoundaryStatsPerRow);
  const auto acc = streams.options().dtype(accumulation_type(streams));
  auto grad_streams = torch::empty_like(streams);
  auto grad_out = torch::empty({g.rows, hidden}, streams.options());
  auto grad_bias = torch::zeros({r.bias.defined() ? hidden : 0}, acc);
  auto weight_grads = torch::zeros({kBoundaryWeightGrads, hidden}, acc);
  if (g.rows > 0) {
    torch::Tensor bias_grad = r.bias.defined() ? grad_bias : torch::Tensor();
    Kernels::residual_dual_norm_backward(gb.defined() ? gb.contiguous() : gb, grad_normed.contiguous(), streams,
                                         r.out, r.bias, r.mask, stats, scale, inv_c, g, w, grad_streams, grad_out,
                                         bias_grad, weight_grads);
  }
  return {grad_streams, grad_out, grad_bias, weight_grads};
}

template <class Kernels>
torch::Tensor dual_residual(const torch::Tensor& base, const torch::Tensor& out, const OptionalTensor& bias,
                            const OptionalTensor& mask, double scale, double inv_c) {
  TORCH_CHECK(out.dim() == 2 && base.dim() == 2 && base.size(0) == out.size(0) && base.size(1) == 2 * out.size(1),
              "dual_residual: base must be [rows, 2h] and out [rows, h]; got ", base.sizes(), " and ",
              out.sizes());
  TORCH_CHECK(base.scalar_type() == out.scalar_type(), "dual_residual: base and out dtypes differ");
  TORCH_CHECK(base.device() == out.device(), "dual_residual: base and out are on different devices");
  torch::Tensor b = defined_or_empty(bias), m = defined_or_empty(mask);
  if (b.defined()) {
    TORCH_CHECK(b.dim() == 1 && b.size(0) == out.size(1), "dual_residual: bias must be [h]");
    TORCH_CHECK(b.scalar_type() == out.scalar_type() || b.scalar_type() == at::kFloat, "dual_residual: bias must be in ",
                "out's dtype (", out.scalar_type(), ") or float32, got ", b.scalar_type());
    TORCH_CHECK(b.device() == out.device(), "dual_residual: bias is on ", b.device(), ", out on ", out.device());
    b = b.to(accumulation_type(out)).contiguous();
  }
  if (m.defined()) {
    TORCH_CHECK(m.scalar_type() == at::kBool && m.sizes() == out.sizes(),
                "dual_residual: mask must be bool with out's shape");
    TORCH_CHECK(m.device() == out.device(), "dual_residual: mask is on ", m.device(), ", out on ", out.device());
    m = m.contiguous();
  }
  auto base_c = base.contiguous();
  auto packed = torch::empty_like(base_c);
  if (out.numel() > 0) Kernels::dual_residual(base_c, out.contiguous(), b, m, scale, inv_c, packed);
  return packed;
}

template <class Kernels>
std::tuple<torch::Tensor, torch::Tensor> dual_residual_backward(const torch::Tensor& grad, const OptionalTensor& mask,
                                                                double scale, double inv_c, bool has_bias) {
  TORCH_CHECK(grad.dim() == 2 && grad.size(1) % 2 == 0, "dual_residual_backward: grad must be [rows, 2h], got ",
              grad.sizes());
  const int64_t rows = grad.size(0), h = grad.size(1) / 2;
  torch::Tensor m = defined_or_empty(mask);
  if (m.defined()) {
    TORCH_CHECK(m.scalar_type() == at::kBool && m.size(0) == rows && m.size(1) == h,
                "dual_residual_backward: mask must be bool [rows, h]");
    m = m.contiguous();
  }
  auto grad_out = torch::empty({rows, h}, grad.options());
  auto grad_bias = torch::zeros({has_bias ? h : 0}, grad.options().dtype(accumulation_type(grad)));
  if (rows * h > 0) {
    torch::Tensor bias_grad = has_bias ? grad_bias : torch::Tensor();
    Kernels::dual_residual_backward(grad.contiguous(), m, scale, inv_c, grad_out, bias_grad);
  }
  return {grad_out, grad_bias};
}

template <class Kernels>
void register_kernels(torch::Library& m) {
  m.impl("dual_norm", &dual_norm<Kernels>);
  m.impl("dual_norm_backward", &dual_norm_backward<Kernels>);
  m.impl("hybrid_dual_norm", &hybrid_dual_norm<Kernels>);
  m.impl("hybrid_dual_norm_backward", &hybrid_dual_norm_backward<Kernels>);
  m.impl("dual_residual", &dual_residual<Kernels>);
  m.impl("dual_residual_backward", &dual_residual_backward<Kernels>);
  m.impl("entry_norm", &entry_norm<Kernels>);
  m.impl("entry_norm_backward", &entry_norm_backward<Kernels>);
  m.impl("hybrid_entry_norm", &hybrid_entry_norm<Kernels>);
  m.impl("hybrid_entry_norm_backward", &hybrid_entry_norm_backward<Kernels>);
  m.impl("residual_dual_norm", &residual_dual_norm<Kernels>);
  m.impl("residual_dual_norm_backward", &residual_dual_norm_backward<Kernels>);
}

}  // namespace
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
  // The hybrid variant's attention side: base [N, 2h] = [x | y] (the X stream keeps x),
  // normed [N, h] = x_scale * x + PreNorm(y) (no InputNorm), stats [N, 6] as dual_norm's (x's
  // are the identity's: mean 0, rstd 1). x_scale (c1) is a plain scale, never zero-centred.
  m.def(
      "hybrid_dual_norm(Tensor streams, int hidden, Tensor x_scale, Tensor y_weight, Tensor? y_bias, "
      "float eps, bool rms, bool zero_centered_gamma) -> (Tensor base, Tensor normed, Tensor stats)");
  // Gradients w.r.t. streams, and weight gradients [3, h] (fp32; fp64 for double) in the order
  // x_scale, y_weight, y_bias (zero without y_bias).
  m.def(
      "hybrid_dual_norm_backward(Tensor grad_base, Tensor grad_normed, Tensor streams, Tensor stats, "
      "int hidden, Tensor x_scale, Tensor y_weight, Tensor? y_bias, bool rms, bool zero_centered_gamma) -> "
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
  // A layer's first sublayer: dual_norm's normed and stats, no base (the streams pass through to
  // the boundary op, which recomputes u from them).
  m.def(
      "entry_norm(Tensor streams, int hidden, Tensor x_weight, Tensor? x_bias, Tensor y_weight, "
      "Tensor? y_bias, Tensor? in_weight, Tensor? in_bias, float eps, bool rms, "
      "bool zero_centered_gamma) -> (Tensor normed, Tensor stats)");
  // Gradients w.r.t. the streams (their pass-through gradient, [N, width], added after the norms'
  // backward) and weight gradients [6, h] in dual_norm's order.
  m.def(
      "entry_norm_backward(Tensor? grad_streams_through, Tensor grad_normed, Tensor streams, Tensor stats, "
      "int hidden, Tensor x_weight, Tensor? x_bias, Tensor y_weight, Tensor? y_bias, "
      "Tensor? in_weight, Tensor? in_bias, bool rms, bool zero_centered_gamma) -> "
      "(Tensor grad_streams, Tensor weight_grads)");
  // The hybrid variant's attention side as a layer's first sublayer: hybrid_dual_norm without base.
  m.def(
      "hybrid_entry_norm(Tensor streams, int hidden, Tensor x_scale, Tensor y_weight, Tensor? y_bias, "
      "float eps, bool rms, bool zero_centered_gamma) -> (Tensor normed, Tensor stats)");
  m.def(
      "hybrid_entry_norm_backward(Tensor? grad_streams_through, Tensor grad_normed, Tensor streams, "
      "Tensor stats, int hidden, Tensor x_scale, Tensor y_weight, Tensor? y_bias, bool rms, "
      "bool zero_centered_gamma) -> (Tensor grad_streams, Tensor weight_grads)");
  // The boundary between two sublayers of a layer: the first's residual update from the layer's
  // streams (u = PostNorm_prev(x), or x without prev_x_weight; x' = u + z * inv_c, y' = y + z,
  // z = (out + bias) * mask * scale) and the second's norms of [x' | y']: base [N, 2h] =
  // [PostNorm(x') | y'], normed [N, h], stats [N, 8] (x's mean and rstd, then dual_norm's six).
  m.def(
      "residual_dual_norm(Tensor streams, Tensor out, Tensor? bias, Tensor? mask, float scale, float inv_c, "
      "int hidden, Tensor? prev_x_weight, Tensor? prev_x_bias, Tensor x_weight, Tensor? x_bias, "
      "Tensor y_weight, Tensor? y_bias, Tensor? in_weight, Tensor? in_bias, float eps, bool rms, "
      "bool zero_centered_gamma) -> (Tensor base, Tensor normed, Tensor stats)");
  // Gradients w.r.t. the streams, out, bias (fp32 [h]; empty without a bias) and the weights
  // [8, h] (fp32): prev_x_weight, prev_x_bias, then dual_norm's six.
  m.def(
      "residual_dual_norm_backward(Tensor? grad_base, Tensor grad_normed, Tensor streams, Tensor out, "
      "Tensor? bias, Tensor? mask, Tensor stats, float scale, float inv_c, int hidden, "
      "Tensor? prev_x_weight, Tensor? prev_x_bias, Tensor x_weight, Tensor? x_bias, Tensor y_weight, "
      "Tensor? y_bias, Tensor? in_weight, Tensor? in_bias, bool rms, bool zero_centered_gamma) -> "
      "(Tensor grad_streams, Tensor grad_out, Tensor grad_bias, Tensor weight_grads)");
}

TORCH_LIBRARY_IMPL(megatron_siamese, CPU, m) {
  megatron_siamese::register_kernels<megatron_siamese::CpuKernels>(m);
}

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(megatron_siamese, CUDA, m) {
  megatron_siamese::register_kernels<megatron_siamese::CudaKernels>(m);
}
#endif

// The ops are reached through torch.ops.megatron_siamese; importing this module loads them.
// The module itself carries the CUDA kernel setting and the tiled kernels' launch plan, a pure
// function, so tests plan every width on CPU with the resources ptxas reports.
namespace {
namespace py = pybind11;
using Candidate = std::tuple<int, int, int, int, int>;  // chunks, shared_per_column, registers, local, static shared

std::vector<megatron_siamese::plan::Resources> resources_of(const std::vector<Candidate>& candidates) {
  std::vector<megatron_siamese::plan::Resources> out;
  for (const auto& [chunks, shared_per_column, registers, local, static_shared] : candidates)
    out.push_back({chunks, shared_per_column, registers, local, static_shared});
  return out;
}

megatron_siamese::plan::Device device_of(int sms, int shared_per_sm, int shared_per_cta) {
  megatron_siamese::plan::Device d;
  d.sms = sms, d.shared_per_sm = shared_per_sm, d.shared_per_cta = shared_per_cta;
  return d;
}

py::dict as_dict(const megatron_siamese::plan::Plan& p) {
  py::dict d;
  d["tiled"] = p.tiled, d["shared_accumulators"] = p.shared_accumulators, d["instantiation"] = p.instantiation;
  d["chunks"] = p.chunks, d["threads_per_row"] = p.threads_per_row, d["rows_per_cta"] = p.rows_per_cta;
  d["ctas_per_sm"] = p.ctas_per_sm, d["grid"] = p.grid, d["dynamic_shared"] = p.dynamic_shared;
  return d;
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using megatron_siamese::KernelGeneration;
  m.def("cuda_kernel_generation", [] {
    return megatron_siamese::cuda_kernel_generation() == KernelGeneration::kTiled ? "tiled" : "verified";
  });
  m.def(
      "plan_forward_rows",
      [](int64_t hidden, int vec, int64_t rows, int sms, int shared_per_sm, int shared_per_cta,
         const std::vector<Candidate>& candidates) {
        return as_dict(megatron_siamese::plan::plan_forward_rows(hidden, vec, rows, device_of(sms, shared_per_sm, shared_per_cta),
                                                                 resources_of(candidates)));
      });
  m.def(
      "plan_backward_rows",
      [](int64_t hidden, int vec, int64_t rows, int sms, int shared_per_sm, int shared_per_cta,
         const std::vector<Candidate>& in_registers, const std::vector<Candidate>& in_shared) {
        return as_dict(megatron_siamese::plan::plan_backward_rows(
            hidden, vec, rows, device_of(sms, shared_per_sm, shared_per_cta), resources_of(in_registers),
            resources_of(in_shared)));
      });
}
