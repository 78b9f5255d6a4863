// The fused ops' autograd, in C++ (registered for the Autograd key): a layer's forward and
// backward run no Python autograd node of ours. Each forward op's Function saves what its
// backward op needs and calls it; each gradient is the op's own (torch.library.opcheck checks
// them against the ops' schemas and fakes, tests/test_kernels.py and test_boundary_ops.py
// against reference/functional.py). One Function serves the norm ops (dual_norm, entry_norm, their
// hybrid forms and the layer entries), one each dual_residual and residual_dual_norm.
//
// layer_entry / hybrid_layer_entry: a layer's first sublayer. Its entry op's output and the
// streams passed through, the latter returned by the Function itself, so the gradient the
// boundary op computes for the streams comes back to the entry op's backward and is added inside
// its kernel (no separate [N, 2h] addition of two gradients). An op returning an input cannot
// have a kernel of its own at the Autograd key, so these two are CompositeImplicitAutograd ops
// whose body is the Function: torch.compile traces through them.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>
#include <torch/types.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace megatron_siamese {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Opt = std::optional<Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

Tensor or_undefined(const Opt& t) { return t.has_value() ? *t : Tensor(); }
Opt optional(const Tensor& t) { return t.defined() ? Opt(t) : Opt(); }
bool wants_grad(const Tensor& t) { return t.defined() && t.requires_grad(); }

// ``t`` or, for a gradient nothing flowed into, zeros of ``like``'s leading shape and ``last`` wide
Tensor or_zeros(const Tensor& t, const Tensor& like, int64_t last) {
  if (t.defined()) return t;
  auto shape = like.sizes().vec();
  shape.back() = last;
  return torch::zeros(shape, like.options());
}

// The gradients of the weights ``first`` .. ``first + count`` of ``saved`` from the backward op's
// list (the present weights' gradients, in order, each in its weight's dtype); none where a weight
// is absent or needs no gradient.
void weight_grads(const variable_list& saved, size_t first, size_t count, const std::vector<Tensor>& present,
                  variable_list& out) {
  size_t next = 0;
  for (size_t i = 0; i < count; ++i) {
    const Tensor& weight = saved[first + i];
    Tensor grad = weight.defined() ? present.at(next++) : Tensor();
    out.push_back(wants_grad(weight) ? grad : Tensor());
  }
}

// -- the norm ops: dual_norm, entry_norm, their hybrid forms, and the layer entries ---------------

using NormSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, int64_t, const Tensor&, const Opt&, const Tensor&,
                                                    const Opt&, const Opt&, const Opt&, double, bool, bool);
using HybridNormSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, int64_t, const Tensor&, const Tensor&,
                                                          const Opt&, double, bool, bool);
using EntrySig = std::tuple<Tensor, Tensor>(const Tensor&, int64_t, const Tensor&, const Opt&, const Tensor&,
                                             const Opt&, const Opt&, const Opt&, double, bool, bool);
using HybridEntrySig = std::tuple<Tensor, Tensor>(const Tensor&, int64_t, const Tensor&, const Tensor&, const Opt&,
                                                   double, bool, bool);
// every backward takes (grad of base or of the streams passed through, grad of normed, streams, stats,
// hidden, the weights, rms, zero_centered_gamma); the entry ops' first is optional
using NormBackwardSig = std::tuple<Tensor, std::vector<Tensor>>(const Tensor&, const Tensor&, const Tensor&,
                                                                 const Tensor&, int64_t, const Tensor&, const Opt&,
                                                                 const Tensor&, const Opt&, const Opt&, const Opt&,
                                                                 bool, bool);
using HybridNormBackwardSig = std::tuple<Tensor, std::vector<Tensor>>(const Tensor&, const Tensor&, const Tensor&,
                                                                       const Tensor&, int64_t, const Tensor&,
                                                                       const Tensor&, const Opt&, bool, bool);
using EntryBackwardSig = std::tuple<Tensor, std::vector<Tensor>>(const Opt&, const Tensor&, const Tensor&,
                                                                  const Tensor&, int64_t, const Tensor&, const Opt&,
                                                                  const Tensor&, const Opt&, const Opt&, const Opt&,
                                                                  bool, bool);
using HybridEntryBackwardSig = std::tuple<Tensor, std::vector<Tensor>>(const Opt&, const Tensor&, const Tensor&,
                                                                        const Tensor&, int64_t, const Tensor&,
                                                                        const Tensor&, const Opt&, bool, bool);

// Which of the norm ops a Norm Function runs: dual_norm (base, normed, stats), an entry op
// (normed, stats), or an entry op whose Function returns the streams too (normed, streams).
enum class NormKind : int64_t { kDualNorm, kEntry, kEntryThrough };

// The op's forward on the weights (six; the hybrid ops' three first), absent ones undefined:
// (base or undefined, normed, stats).
std::tuple<Tensor, Tensor, Tensor> norm_forward(NormKind kind, bool hybrid, const Tensor& streams, int64_t hidden,
                                                const std::vector<Tensor>& w, double eps, bool rms, bool zcg) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto dual = op<NormSig>("megatron_siamese::dual_norm");
  static auto hybrid_dual = op<HybridNormSig>("megatron_siamese::hybrid_dual_norm");
  static auto entry = op<EntrySig>("megatron_siamese::entry_norm");
  static auto hybrid_entry = op<HybridEntrySig>("megatron_siamese::hybrid_entry_norm");
  if (kind == NormKind::kDualNorm)
    return hybrid ? hybrid_dual.call(streams, hidden, w[0], w[1], optional(w[2]), eps, rms, zcg)
                  : dual.call(streams, hidden, w[0], optional(w[1]), w[2], optional(w[3]), optional(w[4]),
                              optional(w[5]), eps, rms, zcg);
  auto [normed, stats] = hybrid ? hybrid_entry.call(streams, hidden, w[0], w[1], optional(w[2]), eps, rms, zcg)
                                : entry.call(streams, hidden, w[0], optional(w[1]), w[2], optional(w[3]),
                                             optional(w[4]), optional(w[5]), eps, rms, zcg);
  return {Tensor(), normed, stats};
}

// The op's backward: (grad_streams, the present weights' gradients). ``grad_first``: base's
// gradient for dual_norm (zeros where none flowed), the pass-through's for an entry op (or none).
std::tuple<Tensor, std::vector<Tensor>> norm_backward(NormKind kind, bool hybrid, const Tensor& grad_first,
                                                      const Tensor& grad_normed, const variable_list& saved,
                                                      int64_t hidden, bool rms, bool zcg) {
  static auto dual = op<NormBackwardSig>("megatron_siamese::dual_norm_backward");
  static auto hybrid_dual = op<HybridNormBackwardSig>("megatron_siamese::hybrid_dual_norm_backward");
  static auto entry = op<EntryBackwardSig>("megatron_siamese::entry_norm_backward");
  static auto hybrid_entry = op<HybridEntryBackwardSig>("megatron_siamese::hybrid_entry_norm_backward");
  const Tensor &streams = saved[0], &stats = saved[1];
  const Tensor normed = or_zeros(grad_normed, streams, hidden);
  if (kind == NormKind::kDualNorm) {
    const Tensor base = or_zeros(grad_first, streams, 2 * hidden);
    return hybrid ? hybrid_dual.call(base, normed, streams, stats, hidden, saved[2], saved[3], optional(saved[4]), rms,
                                     zcg)
                  : dual.call(base, normed, streams, stats, hidden, saved[2], optional(saved[3]), saved[4],
                              optional(saved[5]), optional(saved[6]), optional(saved[7]), rms, zcg);
  }
  return hybrid ? hybrid_entry.call(optional(grad_first), normed, streams, stats, hidden, saved[2], saved[3],
                                    optional(saved[4]), rms, zcg)
                : entry.call(optional(grad_first), normed, streams, stats, hidden, saved[2], optional(saved[3]),
                             saved[4], optional(saved[5]), optional(saved[6]), optional(saved[7]), rms, zcg);
}

// One Function for the norm ops. Arguments: streams, hidden, kind, hybrid, eps, rms,
// zero_centered_gamma, then the op's weights (six, or the hybrid ops' three and three absent).
struct Norm : public torch::autograd::Function<Norm> {
  static variable_list forward(AutogradContext* ctx, const Tensor& streams, int64_t hidden, int64_t kind_index,
                               bool hybrid, double eps, bool rms, bool zero_centered_gamma, const Tensor& w0,
                               const Opt& w1, const Opt& w2, const Opt& w3, const Opt& w4, const Opt& w5) {
    ctx->set_materialize_grads(false);  // an output nothing flowed into: undefined, not zeros
    const auto kind = static_cast<NormKind>(kind_index);
    const std::vector<Tensor> weights{w0, or_undefined(w1), or_undefined(w2), or_undefined(w3), or_undefined(w4),
                                      or_undefined(w5)};
    auto [base, normed, stats] = norm_forward(kind, hybrid, streams, hidden, weights, eps, rms, zero_centered_gamma);
    std::vector<Tensor> saved{streams, stats};
    saved.insert(saved.end(), weights.begin(), weights.begin() + (hybrid ? 3 : 6));
    ctx->save_for_backward(saved);
    ctx->saved_data["hidden"] = hidden;
    ctx->saved_data["kind"] = kind_index;
    ctx->saved_data["hybrid"] = hybrid;
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["zero_centered_gamma"] = zero_centered_gamma;
    // the streams themselves: autograd returns them as a view whose grad_fn is this node
    if (kind == NormKind::kEntryThrough) return {normed, streams};
    ctx->mark_non_differentiable({stats});
    if (kind == NormKind::kEntry) return {normed, stats};
    return {base, normed, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto kind = static_cast<NormKind>(ctx->saved_data["kind"].toInt());
    const bool hybrid = ctx->saved_data["hybrid"].toBool();
    // dual_norm's outputs are (base, normed, stats); an entry's (normed, stats or the streams)
    const Tensor grad_first = kind == NormKind::kDualNorm ? grads[0]
                              : kind == NormKind::kEntryThrough ? grads[1] : Tensor();
    const Tensor grad_normed = kind == NormKind::kDualNorm ? grads[1] : grads[0];
    auto [grad_streams, present] =
        norm_backward(kind, hybrid, grad_first, grad_normed, saved, ctx->saved_data["hidden"].toInt(),
                      ctx->saved_data["rms"].toBool(), ctx->saved_data["zero_centered_gamma"].toBool());
    variable_list out{wants_grad(saved[0]) ? grad_streams : Tensor()};
    out.insert(out.end(), 6, Tensor());  // hidden, kind, hybrid, eps, rms, zero_centered_gamma
    weight_grads(saved, 2, hybrid ? 3 : 6, present, out);
    if (hybrid) out.insert(out.end(), 3, Tensor());  // the weight slots the hybrid ops have not
    return out;
  }
};

template <NormKind Kind>
auto norm(const Tensor& streams, int64_t hidden, const Tensor& x_weight, const Opt& x_bias, const Tensor& y_weight,
          const Opt& y_bias, const Opt& in_weight, const Opt& in_bias, double eps, bool rms,
          bool zero_centered_gamma) {
  auto out = Norm::apply(streams, hidden, static_cast<int64_t>(Kind), false, eps, rms, zero_centered_gamma, x_weight,
                         x_bias, Opt(y_weight), y_bias, in_weight, in_bias);
  if constexpr (Kind == NormKind::kDualNorm) return std::tuple<Tensor, Tensor, Tensor>{out[0], out[1], out[2]};
  else return std::tuple<Tensor, Tensor>{out[0], out[1]};
}

template <NormKind Kind>
auto hybrid_norm(const Tensor& streams, int64_t hidden, const Tensor& x_scale, const Tensor& y_weight,
                 const Opt& y_bias, double eps, bool rms, bool zero_centered_gamma) {
  auto out = Norm::apply(streams, hidden, static_cast<int64_t>(Kind), true, eps, rms, zero_centered_gamma, x_scale,
                         Opt(y_weight), y_bias, Opt(), Opt(), Opt());
  if constexpr (Kind == NormKind::kDualNorm) return std::tuple<Tensor, Tensor, Tensor>{out[0], out[1], out[2]};
  else return std::tuple<Tensor, Tensor>{out[0], out[1]};
}

// -- dual_residual ------------------------------------------------------------------------------

using ResidualSig = Tensor(const Tensor&, const Tensor&, const Opt&, const Opt&, double, double);
using ResidualBackwardSig = std::tuple<Tensor, Tensor>(const Tensor&, const Opt&, double, double,
                                                        std::optional<at::ScalarType>);

struct DualResidual : public torch::autograd::Function<DualResidual> {
  static variable_list forward(AutogradContext* ctx, const Tensor& base, const Tensor& out, const Opt& bias,
                               const Opt& mask, double scale, double inv_c) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->set_materialize_grads(false);  // an output nothing flowed into: undefined, not zeros
    static auto forward_op = op<ResidualSig>("megatron_siamese::dual_residual");
    Tensor packed = forward_op.call(base, out, bias, mask, scale, inv_c);
    // the mask shapes the gradients of out and bias; base's gradient is the incoming one
    const bool out_or_bias = out.requires_grad() || (bias.has_value() && wants_grad(*bias));
    ctx->save_for_backward({out_or_bias ? or_undefined(mask) : Tensor(), or_undefined(bias)});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["inv_c"] = inv_c;
    ctx->saved_data["out_or_bias"] = out_or_bias;
    ctx->saved_data["base"] = base.requires_grad();
    ctx->saved_data["out"] = out.requires_grad();
    return {packed};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto backward_op = op<ResidualBackwardSig>("megatron_siamese::dual_residual_backward");
    const auto saved = ctx->get_saved_variables();
    const Tensor &mask = saved[0], &bias = saved[1];
    Tensor grad_out, grad_bias;
    if (grads[0].defined() && ctx->saved_data["out_or_bias"].toBool()) {
      std::tie(grad_out, grad_bias) = backward_op.call(
          grads[0], optional(mask), ctx->saved_data["scale"].toDouble(), ctx->saved_data["inv_c"].toDouble(),
          bias.defined() ? std::optional<at::ScalarType>(bias.scalar_type()) : std::nullopt);
      grad_out = ctx->saved_data["out"].toBool() ? grad_out : Tensor();
      grad_bias = wants_grad(bias) ? grad_bias : Tensor();
    }
    // d(packed)/d(base) is the identity: the packed gradient is base's
    return {ctx->saved_data["base"].toBool() ? grads[0] : Tensor(), grad_out, grad_bias, Tensor(), Tensor(), Tensor()};
  }
};

Tensor dual_residual_autograd(const Tensor& base, const Tensor& out, const Opt& bias, const Opt& mask, double scale,
                              double inv_c) {
  return DualResidual::apply(base, out, bias, mask, scale, inv_c)[0];
}

// -- residual_dual_norm -------------------------------------------------------------------------

using BoundarySig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Opt&, const Opt&, double,
                                                        double, int64_t, const Opt&, const Opt&, const Tensor&,
                                                        const Opt&, const Tensor&, const Opt&, const Opt&, const Opt&,
                                                        double, bool, bool);
using BoundaryBackwardSig = std::tuple<Tensor, Tensor, Tensor, std::vector<Tensor>>(
    const Opt&, const Tensor&, const Tensor&, const Tensor&, const Opt&, const Opt&, const Tensor&, double, double,
    int64_t, const Opt&, const Opt&, const Tensor&, const Opt&, const Tensor&, const Opt&, const Opt&, const Opt&, bool,
    bool);

struct ResidualDualNorm : public torch::autograd::Function<ResidualDualNorm> {
  static variable_list forward(AutogradContext* ctx, const Tensor& streams, const Tensor& out, const Opt& bias,
                               const Opt& mask, double scale, double inv_c, int64_t hidden, const Opt& prev_x_weight,
                               const Opt& prev_x_bias, const Tensor& x_weight, const Opt& x_bias,
                               const Tensor& y_weight, const Opt& y_bias, const Opt& in_weight, const Opt& in_bias,
                               double eps, bool rms, bool zero_centered_gamma) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->set_materialize_grads(false);  // an output nothing flowed into: undefined, not zeros
    static auto forward_op = op<BoundarySig>("megatron_siamese::residual_dual_norm");
    auto [base, normed, stats] =
        forward_op.call(streams, out, bias, mask, scale, inv_c, hidden, prev_x_weight, prev_x_bias, x_weight, x_bias,
                        y_weight, y_bias, in_weight, in_bias, eps, rms, zero_centered_gamma);
    ctx->save_for_backward({streams, out, or_undefined(bias), or_undefined(mask), stats, or_undefined(prev_x_weight),
                            or_undefined(prev_x_bias), x_weight, or_undefined(x_bias), y_weight, or_undefined(y_bias),
                            or_undefined(in_weight), or_undefined(in_bias)});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["inv_c"] = inv_c;
    ctx->saved_data["hidden"] = hidden;
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["zero_centered_gamma"] = zero_centered_gamma;
    ctx->mark_non_differentiable({stats});
    return {base, normed, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto backward_op = op<BoundaryBackwardSig>("megatron_siamese::residual_dual_norm_backward");
    const auto s = ctx->get_saved_variables();
    const Tensor &streams = s[0], &out = s[1], &bias = s[2];
    const int64_t hidden = ctx->saved_data["hidden"].toInt();
    auto [grad_streams, grad_out, grad_bias, rows] = backward_op.call(
        optional(grads[0]), or_zeros(grads[1], out, hidden), streams, out, optional(bias), optional(s[3]), s[4],
        ctx->saved_data["scale"].toDouble(), ctx->saved_data["inv_c"].toDouble(), hidden, optional(s[5]),
        optional(s[6]), s[7], optional(s[8]), s[9], optional(s[10]), optional(s[11]), optional(s[12]),
        ctx->saved_data["rms"].toBool(), ctx->saved_data["zero_centered_gamma"].toBool());
    variable_list result{wants_grad(streams) ? grad_streams : Tensor(), wants_grad(out) ? grad_out : Tensor(),
                         wants_grad(bias) ? grad_bias : Tensor()};
    result.insert(result.end(), 4, Tensor());  // mask, scale, inv_c, hidden
    weight_grads(s, 5, 8, rows, result);
    result.insert(result.end(), 3, Tensor());  // eps, rms, zero_centered_gamma
    return result;
  }
};

std::tuple<Tensor, Tensor, Tensor> residual_dual_norm_autograd(
    const Tensor& streams, const Tensor& out, const Opt& bias, const Opt& mask, double scale, double inv_c,
    int64_t hidden, const Opt& prev_x_weight, const Opt& prev_x_bias, const Tensor& x_weight, const Opt& x_bias,
    const Tensor& y_weight, const Opt& y_bias, const Opt& in_weight, const Opt& in_bias, double eps, bool rms,
    bool zero_centered_gamma) {
  auto result = ResidualDualNorm::apply(streams, out, bias, mask, scale, inv_c, hidden, prev_x_weight, prev_x_bias,
                                        x_weight, x_bias, y_weight, y_bias, in_weight, in_bias, eps, rms,
                                        zero_centered_gamma);
  return {result[0], result[1], result[2]};
}

}  // namespace
}  // namespace megatron_siamese

TORCH_LIBRARY_FRAGMENT(megatron_siamese, m) {
  // A layer's first sublayer: entry_norm's normed, and the streams themselves (a view whose
  // gradient, handed on to the boundary op, comes back to this op's backward).
  m.def(
      "layer_entry(Tensor(a) streams, int hidden, Tensor x_weight, Tensor? x_bias, Tensor y_weight, "
      "Tensor? y_bias, Tensor? in_weight, Tensor? in_bias, float eps, bool rms, bool zero_centered_gamma) -> "
      "(Tensor normed, Tensor(a) streams_through)");
  m.def(
      "hybrid_layer_entry(Tensor(a) streams, int hidden, Tensor x_scale, Tensor y_weight, Tensor? y_bias, "
      "float eps, bool rms, bool zero_centered_gamma) -> (Tensor normed, Tensor(a) streams_through)");
}

TORCH_LIBRARY_IMPL(megatron_siamese, Autograd, m) {
  using megatron_siamese::NormKind;
  m.impl("dual_norm", &megatron_siamese::norm<NormKind::kDualNorm>);
  m.impl("hybrid_dual_norm", &megatron_siamese::hybrid_norm<NormKind::kDualNorm>);
  m.impl("dual_residual", &megatron_siamese::dual_residual_autograd);
  m.impl("entry_norm", &megatron_siamese::norm<NormKind::kEntry>);
  m.impl("hybrid_entry_norm", &megatron_siamese::hybrid_norm<NormKind::kEntry>);
  m.impl("residual_dual_norm", &megatron_siamese::residual_dual_norm_autograd);
}

TORCH_LIBRARY_IMPL(megatron_siamese, CompositeImplicitAutograd, m) {
  using megatron_siamese::NormKind;
  m.impl("layer_entry", &megatron_siamese::norm<NormKind::kEntryThrough>);
  m.impl("hybrid_layer_entry", &megatron_siamese::hybrid_norm<NormKind::kEntryThrough>);
}
