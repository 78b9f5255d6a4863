// The one host layer of the SiameseNorm fused ops: operator schemas for torch.library, the
// argument checks, weight preparation, output allocation and empty-input handling, shared by
// every device; each device contributes only kernel launchers (dual_norm.h).
//
// Python registers fake (meta) implementations and autograd for these ops
// (megatron_siamese/ops/fused.py), so torch.compile traces through them and
// torch.library.opcheck can validate them, as in pytorch/extension-cpp.
#include <torch/library.h>

#include "dual_norm.h"
#include "launch_plan.h"
#ifdef WITH_CUDA
#include "widened_kernels.h"
#endif

namespace megatron_siamese {
namespace {

using OptionalTensor = c10::optional<torch::Tensor>;

torch::Tensor defined_or_empty(const OptionalTensor& t) {
  return t.has_value() && t->defined() ? *t : torch::Tensor();
}

// The streams are [..., width]: rows of every leading index; outputs keep the leading shape.
StreamRows check_streams(const torch::Tensor& streams, int64_t hidden, const char* op) {
  TORCH_CHECK(streams.dim() >= 1, op, ": streams must be [..., width], got a scalar");
  TORCH_CHECK(streams.is_contiguous(), op, ": streams must be contiguous");
  TORCH_CHECK(hidden > 0, op, ": hidden must be positive, got ", hidden);
  const int64_t width = streams.size(-1);
  TORCH_CHECK(width == hidden || width == 2 * hidden, op,
              ": streams width must be hidden (first layer) or 2 * hidden (packed [x | y]); got width ", width,
              " for hidden ", hidden);
  auto dtype = streams.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble, op,
              ": streams must be float32, bfloat16, float16 or float64, got ", dtype);
  return StreamRows{streams.numel() / width, hidden, width == 2 * hidden};
}

// The streams' leading shape with another last dimension.
std::vector<int64_t> rows_of(const torch::Tensor& streams, int64_t last) {
  auto shape = streams.sizes().vec();
  shape.back() = last;
  return shape;
}

// A weight vector as the kernels read it: [h], on the streams' device, in the streams' dtype or
// float32 (read as it is: no cast), contiguous.
torch::Tensor prepared(const OptionalTensor& t, const torch::Tensor& streams, int64_t hidden, const char* op,
                       const char* name) {
  torch::Tensor w = defined_or_empty(t);
  if (!w.defined()) return w;
  TORCH_CHECK(w.dim() == 1 && w.size(0) == hidden, op, ": ", name, " must have shape [", hidden, "], got ",
              w.sizes());
  TORCH_CHECK(w.device() == streams.device(), op, ": ", name, " is on ", w.device(), ", the streams on ",
              streams.device());
  TORCH_CHECK(w.scalar_type() == streams.scalar_type() || w.scalar_type() == at::kFloat, op, ": ", name,
              " must be in the streams' dtype (", streams.scalar_type(), ") or float32, got ", w.scalar_type());
  return w.contiguous();
}

NormWeights prepare_weights(const torch::Tensor& streams, int64_t hidden, const torch::Tensor& x_weight,
                            const OptionalTensor& x_bias, const torch::Tensor& y_weight,
                            const OptionalTensor& y_bias, const OptionalTensor& in_weight,
                            const OptionalTensor& in_bias, bool rms, bool zero_centered_gamma) {
  constexpr const char* op = "dual_norm";
  NormWeights w;
  w.x_gamma = prepared(x_weight, streams, hidden, op, "x_weight");
  w.y_gamma = prepared(y_weight, streams, hidden, op, "y_weight");
  w.in_gamma = prepared(in_weight, streams, hidden, op, "in_weight");
  w.x_beta = prepared(x_bias, streams, hidden, op, "x_bias");
  w.y_beta = prepared(y_bias, streams, hidden, op, "y_bias");
  w.in_beta = prepared(in_bias, streams, hidden, op, "in_bias");
  w.rms = rms;
  w.zero_centered = zero_centered_gamma;
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
  w.x_gamma = prepared(x_scale, streams, hidden, op, "x_scale");
  w.y_gamma = prepared(y_weight, streams, hidden, op, "y_weight");
  w.y_beta = prepared(y_bias, streams, hidden, op, "y_bias");
  w.rms = rms;
  w.zero_centered = zero_centered_gamma;  // y's gamma; c1 is a plain scale
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
  auto base = weights.base_is_streams ? torch::Tensor() : torch::empty(rows_of(streams, 2 * geometry.hidden), streams.options());
  auto normed = torch::empty(rows_of(streams, geometry.hidden), streams.options());
  auto stats = torch::empty({geometry.rows, kStatsPerRow}, streams.options().dtype(accumulation_type(streams)));
  if (geometry.rows > 0) Kernels::dual_norm(streams, geometry, weights, eps, base, normed, stats);
  return {base, normed, stats};
}

// Checks a gradient that the backward ops take beside the streams: the streams' leading shape and
// ``cols`` wide, their device and dtype. Optional ones (grad_base of the entry and boundary ops)
// may be undefined.
void check_gradient(const char* op, const char* name, const torch::Tensor& grad, const torch::Tensor& streams,
                    int64_t cols, const char* shape) {
  if (!grad.defined()) return;
  TORCH_CHECK(grad.sizes() == c10::IntArrayRef(rows_of(streams, cols)), op, ": ", name, " must be ", shape,
              " (the streams' leading shape), got ", grad.sizes());
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

// One [h] gradient per weight, in its dtype, in the order of ``slots`` (undefined where a weight is
// absent), for the kernels; and the present ones alone, in that order, for the op's caller.
struct WeightGrads {
  std::vector<torch::Tensor> slots, present;
};

// Outputs come from torch::empty, not empty_like (which dispatches empty_strided too): one operator
// per allocation, for a host-bound layer; every tensor they are shaped after is contiguous.
WeightGrads weight_grads_for(std::initializer_list<const torch::Tensor*> weights) {
  WeightGrads g;
  for (const torch::Tensor* w : weights) {
    g.slots.push_back(w->defined() ? torch::empty(w->sizes(), w->options()) : torch::Tensor());
    if (w->defined()) g.present.push_back(g.slots.back());
  }
  return g;
}

// The backward of the norm ops: grad_streams and the present weights' gradients in dual_norm's order.
// grad_base: base's gradient [rows, 2h], or for the entry ops (base_is_streams) the streams'
// pass-through gradient [rows, width], which may be undefined (no such path).
template <class Kernels>
std::tuple<torch::Tensor, std::vector<torch::Tensor>> norm_backward(const char* op, const torch::Tensor& grad_base,
                                                       const torch::Tensor& grad_normed, const torch::Tensor& streams,
                                                       const torch::Tensor& stats, const StreamRows& geometry,
                                                       const NormWeights& weights) {
  const int64_t hidden = geometry.hidden;
  if (weights.base_is_streams) {
    check_gradient(op, "grad_streams_through", grad_base, streams, geometry.width(), "the streams' shape");
  } else {
    TORCH_CHECK(grad_base.defined(), op, ": grad_base is required");
    check_gradient(op, "grad_base", grad_base, streams, 2 * hidden, "[..., 2 * hidden]");
  }
  TORCH_CHECK(grad_normed.defined(), op, ": grad_normed is required");
  check_gradient(op, "grad_normed", grad_normed, streams, hidden, "[..., hidden]");
  check_stats(op, stats, streams, geometry.rows, kStatsPerRow);
  auto gb = grad_base.defined() ? grad_base.contiguous() : grad_base;
  auto gn = grad_normed.contiguous();
  auto grad_streams = torch::empty(streams.sizes(), streams.options());
  WeightGrads grads = weight_grads_for({&weights.x_gamma, &weights.x_beta, &weights.y_gamma, &weights.y_beta,
                                        &weights.in_gamma, &weights.in_beta});
  if (geometry.rows > 0) {
    Kernels::dual_norm_backward(gb, gn, streams, stats, geometry, weights, grad_streams, grads.slots);
  } else {
    for (auto& g : grads.present) g.zero_();  // no rows: no gradient
  }
  return {grad_streams, grads.present};
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
std::tuple<torch::Tensor, std::vector<torch::Tensor>> dual_norm_backward(
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
std::tuple<torch::Tensor, std::vector<torch::Tensor>> hybrid_dual_norm_backward(
    const torch::Tensor& grad_base, const torch::Tensor& grad_normed, const torch::Tensor& streams,
    const torch::Tensor& stats, int64_t hidden, const torch::Tensor& x_scale, const torch::Tensor& y_weight,
    const OptionalTensor& y_bias, bool rms, bool zero_centered_gamma) {
  const StreamRows geometry = check_streams(streams, hidden, "hybrid_dual_norm_backward");
  return norm_backward<Kernels>("hybrid_dual_norm_backward", grad_base, grad_normed, streams, stats, geometry,
                                prepare_hybrid_weights(streams, hidden, x_scale, y_weight, y_bias, rms,
                                                       zero_centered_gamma));
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
std::tuple<torch::Tensor, std::vector<torch::Tensor>> entry_norm_backward(
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
std::tuple<torch::Tensor, std::vector<torch::Tensor>> hybrid_entry_norm_backward(
    const OptionalTensor& grad_streams_through, const torch::Tensor& grad_normed, const torch::Tensor& streams,
    const torch::Tensor& stats, int64_t hidden, const torch::Tensor& x_scale, const torch::Tensor& y_weight,
    const OptionalTensor& y_bias, bool rms, bool zero_centered_gamma) {
  const StreamRows geometry = check_streams(streams, hidden, "hybrid_entry_norm_backward");
  NormWeights weights = prepare_hybrid_weights(streams, hidden, x_scale, y_weight, y_bias, rms, zero_centered_gamma);
  weights.base_is_streams = true;
  return norm_backward<Kernels>("hybrid_entry_norm_backward", defined_or_empty(grad_streams_through), grad_normed,
                                streams, stats, geometry, weights);
}

// residual_dual_norm's inputs besides the streams, checked against the streams.
ResidualInputs check_residual_inputs(const char* op, const torch::Tensor& streams, const StreamRows& g,
                                     const torch::Tensor& out, const OptionalTensor& bias, const OptionalTensor& mask,
                                     double scale, double inv_c) {
  TORCH_CHECK(out.sizes() == c10::IntArrayRef(rows_of(streams, g.hidden)), op,
              ": out must be the streams' leading shape and hidden wide, ", c10::IntArrayRef(rows_of(streams, g.hidden)),
              ", got ", out.sizes());
  TORCH_CHECK(out.device() == streams.device(), op, ": out is on ", out.device(), ", the streams on ",
              streams.device());
  TORCH_CHECK(out.scalar_type() == streams.scalar_type(), op, ": out (", out.scalar_type(),
              ") must be in the streams' dtype (", streams.scalar_type(), ")");
  ResidualInputs r{out.contiguous(), defined_or_empty(bias), defined_or_empty(mask), scale, inv_c};
  if (r.bias.defined()) {
    TORCH_CHECK(r.bias.dim() == 1 && r.bias.size(0) == g.hidden, op, ": bias must be [", g.hidden, "], got ",
                r.bias.sizes());
    TORCH_CHECK(r.bias.device() == streams.device(), op, ": bias is on ", r.bias.device(), ", the streams on ",
                streams.device());
    TORCH_CHECK(r.bias.scalar_type() == streams.scalar_type() || r.bias.scalar_type() == at::kFloat, op,
                ": bias must be in the streams' dtype (", streams.scalar_type(), ") or float32, got ",
                r.bias.scalar_type());
    r.bias = r.bias.contiguous();
  }
  if (r.mask.defined()) {
    TORCH_CHECK(r.mask.scalar_type() == at::kBool && r.mask.sizes() == r.out.sizes(), op,
                ": mask must be bool with out's shape");
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
  w.prev_gamma = prepared(prev_x_weight, streams, hidden, op, "prev_x_weight");
  w.prev_beta = prepared(prev_x_bias, streams, hidden, op, "prev_x_bias");
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
  const ResidualInputs r = check_residual_inputs(op, streams, g, out, bias, mask, scale, inv_c);
  const NormWeights w = prepare_boundary_weights(op, streams, hidden, prev_x_weight, prev_x_bias, x_weight, x_bias,
                                                 y_weight, y_bias, in_weight, in_bias, rms, zero_centered_gamma);
  auto base = torch::empty(rows_of(streams, 2 * hidden), streams.options());
  auto normed = torch::empty(rows_of(streams, hidden), streams.options());
  auto stats = torch::empty({g.rows, kBoundaryStatsPerRow}, streams.options().dtype(accumulation_type(streams)));
  if (g.rows > 0) Kernels::residual_dual_norm(streams, r, g, w, eps, base, normed, stats);
  return {base, normed, stats};
}

template <class Kernels>
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, std::vector<torch::Tensor>> residual_dual_norm_backward(
    const OptionalTensor& grad_base, const torch::Tensor& grad_normed, const torch::Tensor& streams,
    const torch::Tensor& out, const OptionalTensor& bias, const OptionalTensor& mask, const torch::Tensor& stats,
    double scale, double inv_c, int64_t hidden, const OptionalTensor& prev_x_weight, const OptionalTensor& prev_x_bias,
    const torch::Tensor& x_weight, const OptionalTensor& x_bias, const torch::Tensor& y_weight,
    const OptionalTensor& y_bias, const OptionalTensor& in_weight, const OptionalTensor& in_bias, bool rms,
    bool zero_centered_gamma) {
  constexpr const char* op = "residual_dual_norm_backward";
  const StreamRows g = check_streams(streams, hidden, op);
  const ResidualInputs r = check_residual_inputs(op, streams, g, out, bias, mask, scale, inv_c);
  const NormWeights w = prepare_boundary_weights(op, streams, hidden, prev_x_weight, prev_x_bias, x_weight, x_bias,
                                                 y_weight, y_bias, in_weight, in_bias, rms, zero_centered_gamma);
  const torch::Tensor gb = defined_or_empty(grad_base);
  check_gradient(op, "grad_base", gb, streams, 2 * hidden, "[..., 2 * hidden]");
  check_gradient(op, "grad_normed", grad_normed, streams, hidden, "[..., hidden]");
  check_stats(op, stats, streams, g.rows, kBoundaryStatsPerRow);
  auto grad_streams = torch::empty(streams.sizes(), streams.options());
  auto grad_out = torch::empty(rows_of(streams, hidden), streams.options());
  auto grad_bias = r.bias.defined() ? torch::empty(r.bias.sizes(), r.bias.options())
                                    : torch::empty({0}, streams.options().dtype(accumulation_type(streams)));
  WeightGrads grads = weight_grads_for({&w.prev_gamma, &w.prev_beta, &w.x_gamma, &w.x_beta, &w.y_gamma, &w.y_beta,
                                        &w.in_gamma, &w.in_beta});
  if (g.rows > 0) {
    torch::Tensor bias_grad = r.bias.defined() ? grad_bias : torch::Tensor();
    Kernels::residual_dual_norm_backward(gb.defined() ? gb.contiguous() : gb, grad_normed.contiguous(), streams, r,
                                         stats, g, w, grad_streams, grad_out, bias_grad, grads.slots);
  } else {
    grad_bias.zero_();
    for (auto& grad : grads.present) grad.zero_();
  }
  return {grad_streams, grad_out, grad_bias, grads.present};
}

template <class Kernels>
torch::Tensor dual_residual(const torch::Tensor& base, const torch::Tensor& out, const OptionalTensor& bias,
                            const OptionalTensor& mask, double scale, double inv_c) {
  TORCH_CHECK(out.dim() >= 1 && base.sizes() == c10::IntArrayRef(rows_of(out, 2 * out.size(-1))),
              "dual_residual: base must be [..., 2h] and out [..., h] (one leading shape); got ", base.sizes(), " and ",
              out.sizes());
  TORCH_CHECK(base.scalar_type() == out.scalar_type(), "dual_residual: base and out dtypes differ");
  TORCH_CHECK(base.device() == out.device(), "dual_residual: base and out are on different devices");
  torch::Tensor b = defined_or_empty(bias), m = defined_or_empty(mask);
  if (b.defined()) {
    TORCH_CHECK(b.dim() == 1 && b.size(0) == out.size(-1), "dual_residual: bias must be [h]");
    TORCH_CHECK(b.scalar_type() == out.scalar_type() || b.scalar_type() == at::kFloat, "dual_residual: bias must be in ",
                "out's dtype (", out.scalar_type(), ") or float32, got ", b.scalar_type());
    TORCH_CHECK(b.device() == out.device(), "dual_residual: bias is on ", b.device(), ", out on ", out.device());
    b = b.contiguous();
  }
  if (m.defined()) {
    TORCH_CHECK(m.scalar_type() == at::kBool && m.sizes() == out.sizes(),
                "dual_residual: mask must be bool with out's shape");
    TORCH_CHECK(m.device() == out.device(), "dual_residual: mask is on ", m.device(), ", out on ", out.device());
    m = m.contiguous();
  }
  auto base_c = base.contiguous();
  auto packed = torch::empty(base_c.sizes(), base_c.options());
  if (out.numel() > 0) Kernels::dual_residual(base_c, out.contiguous(), b, m, scale, inv_c, packed);
  return packed;
}

template <class Kernels>
std::tuple<torch::Tensor, torch::Tensor> dual_residual_backward(const torch::Tensor& grad, const OptionalTensor& mask,
                                                                double scale, double inv_c,
                                                                std::optional<at::ScalarType> bias_dtype) {
  TORCH_CHECK(grad.dim() >= 1 && grad.size(-1) % 2 == 0, "dual_residual_backward: grad must be [..., 2h], got ",
              grad.sizes());
  const int64_t h = grad.size(-1) / 2, rows = h > 0 ? grad.numel() / (2 * h) : 0;
  torch::Tensor m = defined_or_empty(mask);
  if (m.defined()) {
    TORCH_CHECK(m.scalar_type() == at::kBool && m.sizes() == c10::IntArrayRef(rows_of(grad, h)),
                "dual_residual_backward: mask must be bool [..., h] (grad's leading shape)");
    m = m.contiguous();
  }
  auto grad_out = torch::empty(rows_of(grad, h), grad.options());
  auto grad_bias = torch::empty({bias_dtype ? h : 0}, grad.options().dtype(bias_dtype.value_or(accumulation_type(grad))));
  if (rows * h > 0) {
    torch::Tensor bias_grad = bias_dtype ? grad_bias : torch::Tensor();
    Kernels::dual_residual_backward(grad.contiguous(), m, scale, inv_c, grad_out, bias_grad);
  } else {
    grad_bias.zero_();
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
  // Gradients w.r.t. streams, and the weights' gradients (each in its weight's dtype) for the
  // weights given, in the order x_weight, x_bias, y_weight, y_bias, in_weight, in_bias.
  m.def(
      "dual_norm_backward(Tensor grad_base, Tensor grad_normed, Tensor streams, Tensor stats, "
      "int hidden, Tensor x_weight, Tensor? x_bias, Tensor y_weight, Tensor? y_bias, "
      "Tensor? in_weight, Tensor? in_bias, bool rms, bool zero_centered_gamma) -> "
      "(Tensor grad_streams, Tensor[] weight_grads)");
  // The hybrid variant's attention side: base [N, 2h] = [x | y] (the X stream keeps x),
  // normed [N, h] = x_scale * x + PreNorm(y) (no InputNorm), stats [N, 6] as dual_norm's (x's
  // are the identity's: mean 0, rstd 1). x_scale (c1) is a plain scale, never zero-centred.
  m.def(
      "hybrid_dual_norm(Tensor streams, int hidden, Tensor x_scale, Tensor y_weight, Tensor? y_bias, "
      "float eps, bool rms, bool zero_centered_gamma) -> (Tensor base, Tensor normed, Tensor stats)");
  // Gradients w.r.t. streams, and the weights' gradients in the order x_scale, y_weight, y_bias.
  m.def(
      "hybrid_dual_norm_backward(Tensor grad_base, Tensor grad_normed, Tensor streams, Tensor stats, "
      "int hidden, Tensor x_scale, Tensor y_weight, Tensor? y_bias, bool rms, bool zero_centered_gamma) -> "
      "(Tensor grad_streams, Tensor[] weight_grads)");
  // out_packed = base + [z * inv_c | z], z = (out + bias) * mask * scale.
  m.def(
      "dual_residual(Tensor base, Tensor out, Tensor? bias, Tensor? mask, float scale, "
      "float inv_c) -> Tensor");
  // (grad_out, grad_bias) from the packed output's gradient; grad_bias is [h] in bias_dtype (empty
  // without a bias). grad_base is the incoming gradient itself.
  m.def(
      "dual_residual_backward(Tensor grad, Tensor? mask, float scale, float inv_c, "
      "ScalarType? bias_dtype) -> (Tensor grad_out, Tensor grad_bias)");
  // A layer's first sublayer: dual_norm's normed and stats, no base (the streams pass through to
  // the boundary op, which recomputes u from them).
  m.def(
      "entry_norm(Tensor streams, int hidden, Tensor x_weight, Tensor? x_bias, Tensor y_weight, "
      "Tensor? y_bias, Tensor? in_weight, Tensor? in_bias, float eps, bool rms, "
      "bool zero_centered_gamma) -> (Tensor normed, Tensor stats)");
  // Gradients w.r.t. the streams (their pass-through gradient, the streams' shape, added after the
  // norms' backward) and the weights' gradients as dual_norm_backward's.
  m.def(
      "entry_norm_backward(Tensor? grad_streams_through, Tensor grad_normed, Tensor streams, Tensor stats, "
      "int hidden, Tensor x_weight, Tensor? x_bias, Tensor y_weight, Tensor? y_bias, "
      "Tensor? in_weight, Tensor? in_bias, bool rms, bool zero_centered_gamma) -> "
      "(Tensor grad_streams, Tensor[] weight_grads)");
  // The hybrid variant's attention side as a layer's first sublayer: hybrid_dual_norm without base.
  m.def(
      "hybrid_entry_norm(Tensor streams, int hidden, Tensor x_scale, Tensor y_weight, Tensor? y_bias, "
      "float eps, bool rms, bool zero_centered_gamma) -> (Tensor normed, Tensor stats)");
  m.def(
      "hybrid_entry_norm_backward(Tensor? grad_streams_through, Tensor grad_normed, Tensor streams, "
      "Tensor stats, int hidden, Tensor x_scale, Tensor y_weight, Tensor? y_bias, bool rms, "
      "bool zero_centered_gamma) -> (Tensor grad_streams, Tensor[] weight_grads)");
  // The boundary between two sublayers of a layer: the first's residual update from the layer's
  // streams (u = PostNorm_prev(x), or x without prev_x_weight; x' = u + z * inv_c, y' = y + z,
  // z = (out + bias) * mask * scale) and the second's norms of [x' | y']: base [N, 2h] =
  // [PostNorm(x') | y'], normed [N, h], stats [N, 8] (x's mean and rstd, then dual_norm's six).
  m.def(
      "residual_dual_norm(Tensor streams, Tensor out, Tensor? bias, Tensor? mask, float scale, float inv_c, "
      "int hidden, Tensor? prev_x_weight, Tensor? prev_x_bias, Tensor x_weight, Tensor? x_bias, "
      "Tensor y_weight, Tensor? y_bias, Tensor? in_weight, Tensor? in_bias, float eps, bool rms, "
      "bool zero_centered_gamma) -> (Tensor base, Tensor normed, Tensor stats)");
  // Gradients w.r.t. the streams, out, bias ([h] in its dtype; empty without a bias) and the weights
  // given (each in its dtype), in the order prev_x_weight, prev_x_bias, then dual_norm's six.
  m.def(
      "residual_dual_norm_backward(Tensor? grad_base, Tensor grad_normed, Tensor streams, Tensor out, "
      "Tensor? bias, Tensor? mask, Tensor stats, float scale, float inv_c, int hidden, "
      "Tensor? prev_x_weight, Tensor? prev_x_bias, Tensor x_weight, Tensor? x_bias, Tensor y_weight, "
      "Tensor? y_bias, Tensor? in_weight, Tensor? in_bias, bool rms, bool zero_centered_gamma) -> "
      "(Tensor grad_streams, Tensor grad_out, Tensor grad_bias, Tensor[] weight_grads)");
}

TORCH_LIBRARY_IMPL(megatron_siamese, CPU, m) {
  megatron_siamese::register_kernels<megatron_siamese::CpuKernels>(m);
}

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(megatron_siamese, CUDA, m) {
  megatron_siamese::register_kernels<megatron_siamese::CudaKernels>(m);
}
#endif
